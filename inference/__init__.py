"""Inference: prepared models (``models``), the vLLM server's lifecycle (``server``), replicas and keys
(``replicas``, ``auth``), weight sync (``weight_sync``, ``weight_broadcast``) and the async token-id client
(``client``). Import the module you need; importing the package loads nothing else."""
