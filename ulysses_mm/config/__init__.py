"""Typed configuration: dataclasses are the schema, YAML only gives values.

:mod:`.schema` is the run (``configs/*.yaml``), :mod:`.pipeline` raw files to shards
(``pipelines/*.yaml``), :mod:`.parse` the machinery both use (types checked, unknown keys
rejected with the closest name, CLI > file > defaults).
"""

from ulysses_mm.config.parse import (
    ConfigError,
    deep_merge,
    describe,
    from_dict,
    load_config,
    parse_overrides,
    read_yaml,
    to_dict,
)
from ulysses_mm.config.pipeline import PackConfig, PipelineConfig, ShardConfig
from ulysses_mm.config.schema import (
    AttentionKernel,
    DataConfig,
    DeepSpeedConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RopeConfig,
    RunConfig,
    SchedulerConfig,
    StageConfig,
    TrainConfig,
    TrainSource,
)
from ulysses_mm.config.stages import Stage, run_stages, stage_of

__all__ = [
    "AttentionKernel",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PackConfig",
    "ParallelConfig",
    "PipelineConfig",
    "RopeConfig",
    "RunConfig",
    "SchedulerConfig",
    "ShardConfig",
    "Stage",
    "StageConfig",
    "TrainConfig",
    "TrainSource",
    "deep_merge",
    "describe",
    "from_dict",
    "load_config",
    "parse_overrides",
    "read_yaml",
    "run_stages",
    "stage_of",
    "to_dict",
]
