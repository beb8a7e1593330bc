"""Offline Meta-IO build (see :mod:`meta_io.build.pipeline`)."""

from meta_io.build.pipeline import BuildResult, EpisodePlan, MetaIOBuildConfig, build, dataset_files, plan_episodes

__all__ = ["BuildResult", "EpisodePlan", "MetaIOBuildConfig", "build", "dataset_files", "plan_episodes"]
