"""Synthetic data: the multi-scenario log generator, apart from the Meta-IO pipeline.

The generator writes raw Parquet logs and a schema that the pipeline
(:mod:`meta_io.source`, :mod:`meta_io.build`) reads like any user data; the
pipeline never imports it.
"""

from meta_io.synth.generator import (
    HIDDEN_KNOBS, SCENES, TASTE_KNOBS, WORLDS, GeneratedData, GeneratorConfig, generate, generator_schema,
    world_config,
)

__all__ = ["HIDDEN_KNOBS", "SCENES", "TASTE_KNOBS", "WORLDS", "GeneratedData", "GeneratorConfig", "generate",
           "generator_schema", "world_config"]
