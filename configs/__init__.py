"""Experiment configs: YAML files in this folder, validated into typed settings."""

from pettingflow.configs.loader import ConfigError, available_configs, dump_config, load_config
from pettingflow.configs.settings import ExperimentConfig, Specialization

__all__ = ["ConfigError", "ExperimentConfig", "Specialization", "available_configs", "dump_config", "load_config"]
