"""Offline Meta-IO build, one module per stage.

    config     MetaIOBuildConfig, BuildResult
    plan       episode planning (pure numpy): plan_episodes, EpisodePlan
    writers    rolling Arrow IPC part/leftover writers
    packers    fixed-shape bucket packing (meta) and plain packing
    pass1      stream, check and partition the input into spill files
    pass2      sort each partition, plan episodes, pack (or shuffle rows)
    manifest   manifest.json, checksums, atomic publish; dataset_files
    pipeline   build(): the two passes end to end (the design is in its docstring)
"""

from meta_io.build.config import BuildResult, MetaIOBuildConfig
from meta_io.build.manifest import dataset_files
from meta_io.build.pipeline import build
from meta_io.build.plan import EpisodePlan, plan_episodes

__all__ = ["BuildResult", "EpisodePlan", "MetaIOBuildConfig", "build", "dataset_files", "plan_episodes"]
