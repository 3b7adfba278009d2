"""Environments: the ``Env`` base, the env registry and cache, HumanEval tasks and the code env.

The sandbox that runs model-written code lives in ``pettingflow.envs.sandbox``.
"""

from pettingflow.envs.base import Env, EnvConfig, EnvConfigError, TaskDataError
from pettingflow.envs.code_env import (
    CodeEnv,
    CodeEnvConfig,
    CodeEnvState,
    SuiteResult,
    UnitTestReward,
    code_reward,
    code_success,
    unit_test_reward,
)
from pettingflow.envs.humaneval import TaskFileError, TaskSplit, load_humaneval, load_task_file, load_tasks, split_tasks
from pettingflow.envs.registry import (
    EnvCache,
    EnvFactory,
    EnvSpec,
    RegistryError,
    TaskSpec,
    env_spec_from_settings,
    register_env,
    registered_envs,
    resolve_env_class,
    task_specs_from_rows,
)

__all__ = [
    "CodeEnv",
    "CodeEnvConfig",
    "CodeEnvState",
    "Env",
    "EnvCache",
    "EnvConfig",
    "EnvConfigError",
    "EnvFactory",
    "EnvSpec",
    "RegistryError",
    "SuiteResult",
    "TaskDataError",
    "TaskFileError",
    "TaskSpec",
    "TaskSplit",
    "UnitTestReward",
    "code_reward",
    "code_success",
    "env_spec_from_settings",
    "load_humaneval",
    "load_task_file",
    "load_tasks",
    "register_env",
    "registered_envs",
    "resolve_env_class",
    "split_tasks",
    "task_specs_from_rows",
    "unit_test_reward",
]
