"""Inference layer: prepared models, the vLLM server lifecycle, weight sync and the async token-id client.

Importing this package is cheap (no torch, transformers or vLLM import); those load on first use.
"""

from pettingflow.inference.client import Completion, InferenceClient, InferenceError
from pettingflow.inference.models import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ModelError,
    ModelNotPreparedError,
    ModelPreparationError,
    is_prepared,
    model_dir,
    prepare_model,
    resolve_model,
    verify_model_dir,
)
from pettingflow.inference.server import (
    ExternalServer,
    ServerError,
    ServerStartupError,
    VLLMServer,
    attach,
    check_health,
    detect_device,
    server_from_settings,
)
from pettingflow.inference.weight_sync import (
    Fingerprint,
    WeightSyncError,
    fingerprint,
    load_lora_adapter,
    sync_full_weights,
    unload_lora_adapter,
)

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "Completion",
    "ExternalServer",
    "Fingerprint",
    "InferenceClient",
    "InferenceError",
    "ModelError",
    "ModelNotPreparedError",
    "ModelPreparationError",
    "ServerError",
    "ServerStartupError",
    "VLLMServer",
    "WeightSyncError",
    "attach",
    "check_health",
    "detect_device",
    "fingerprint",
    "is_prepared",
    "load_lora_adapter",
    "model_dir",
    "prepare_model",
    "resolve_model",
    "server_from_settings",
    "sync_full_weights",
    "unload_lora_adapter",
    "verify_model_dir",
]
