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
    RunConfig,
    SchedulerConfig,
    TrainConfig,
    TrainSource,
)

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
    "RunConfig",
    "SchedulerConfig",
    "ShardConfig",
    "TrainConfig",
    "TrainSource",
    "deep_merge",
    "describe",
    "from_dict",
    "load_config",
    "parse_overrides",
    "read_yaml",
    "to_dict",
]
