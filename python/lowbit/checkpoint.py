"""NVFP4 checkpoints (NVIDIA ModelOpt, compressed-tensors) loaded into Hugging
Face transformers models, with lowbit's layers in place of the quantized ones.

:func:`load_pretrained` builds a transformers model from a checkpoint
directory and loads it; :func:`load_checkpoint_` loads a directory into a
model you built (its parameters may be on the meta device). Each module of
the checkpoint becomes, by what its tensors are:

- an NVFP4 Linear (``weight`` uint8 [N, K/2], ``weight_scale`` E4M3
  [N, K/16] and ModelOpt's ``weight_scale_2`` = amax / 2688, or
  compressed-tensors' ``weight_packed``, ``weight_scale`` and
  ``weight_global_scale`` = 2688 / amax): an :class:`~lowbit.nn.Nvfp4Linear`,
  or for transformers' ``DeepseekV4GroupedLinear`` an
  :class:`~lowbit.nn.Nvfp4GroupedLinear`;
- a transformers DeepSeek MoE block (``DeepseekV3MoE``,
  ``DeepseekV4SparseMoeBlock``) whose experts are NVFP4, stored one expert
  per module as ModelOpt exports them (``<block>.experts.<e>.gate_proj``,
  ``up_proj``, ``down_proj``; DeepSeek's ``w1``, ``w3``, ``w2`` too) with an
  NVFP4 shared expert: an :class:`~lowbit.nn.Nvfp4MoE` (routing from the
  block, experts as stored: no requantization);
- anything else (embeddings, norms, routers, BF16 layers): the model's own
  parameter or buffer, cast to its dtype.

Activation and KV-cache scales (``input_scale``, ``input_global_scale``,
``k_scale``, ``v_scale``) are not used: the layers run W4A16, or with
``compute`` FP8 with activation scales of their own. Checkpoints in other
quantized formats (FP8, MXFP4, INT4) are refused by name.

What a checkpoint must hold, and what it may not (ValueError naming the
key, with what was expected and what was found): every parameter of the
model, and the MoE routers' ``e_score_correction_bias`` and hash layers'
``tid2eid`` (buffers that only checkpoints have: the model's placeholder
zeros would choose the wrong experts); other persistent buffers it lacks
keep the model's values (``LoadReport.not_in_checkpoint``, a warning).
Tensors are cast to the model's dtype between floating-point types only:
integers for a float parameter, or floats for an integer buffer, are
refused. NVFP4 global scales are float32, ModelOpt's finite and >= 0,
compressed-tensors' > 0. Beside an NVFP4 module's three tensors, a
tensor that would change the output if dropped is refused: a ``bias`` on
an expert or shared expert of an MoE block (Nvfp4MoE has none), an AWQ
``pre_quant_scale``, a nonzero ``weight_zero_point`` (an all-zero one is
skipped, as ``LoadReport.ignored``). Any other tensor there, and a
``bias`` on a grouped layer (which transformers ignores as well), is
reported in ``LoadReport.unused`` with a warning. Malformed
``hf_quant_config.json``, ``config.json`` or safetensors index files are
refused naming the file and field.

A checkpoint is read one tensor at a time, so the peak memory is the loaded
model plus one expert's conversion. :func:`save_pretrained` writes a model
with lowbit's layers back as a ModelOpt checkpoint that these load.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from . import _placement
from ._progress import progress_bar
from .nn.linear import global_from_compressed_tensors

# Leaf names of the NVFP4 tensors, by format; the first names the format.
_MODELOPT = ("weight_scale_2", "weight", "weight_scale")
_COMPRESSED = ("weight_global_scale", "weight_packed", "weight_scale")
# Activation and KV-cache scales: W4A16 uses none of them.
_UNUSED_SCALES = frozenset({"input_scale", "input_global_scale", "k_scale", "v_scale"})
# Leaves that mark a quantized format lowbit does not load (DeepSeek's FP8
# blocks, compressed-tensors' INT formats, ModelOpt's AWQ).
_OTHER_FORMATS = frozenset({"weight_scale_inv", "weight_zero_point", "weight_shape", "pre_quant_scale"})
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_SHARED = ("gate_proj", "up_proj", "down_proj")


def _err(arg: str, message: str) -> str:
    return f"lowbit.load_checkpoint_: {arg} {message}"


@dataclass
class LoadReport:
    """What :func:`load_checkpoint_` did. ``linear``, ``grouped`` and
    ``moe``: the module names replaced by Nvfp4Linear, Nvfp4GroupedLinear
    and Nvfp4MoE; ``unused``: checkpoint keys with no place in the model
    (a warning names them); ``ignored``: keys skipped on purpose (activation
    and KV-cache scales, the model's ``_keys_to_ignore_on_load_unexpected``,
    keys ``key_map`` dropped, all-zero ``weight_zero_point``);
    ``not_in_checkpoint``: persistent buffers the checkpoint does not hold,
    which keep the model's own values (never a MoE router's: those are
    required)."""

    linear: list[str] = field(default_factory=list)
    grouped: list[str] = field(default_factory=list)
    moe: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    not_in_checkpoint: list[str] = field(default_factory=list)


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(_err("path", f"holds {file}, which is not valid JSON: {e}")) from None


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _object(value: object, file: Path, field: str) -> dict:
    """``value`` (the JSON ``field`` of ``file``) checked to be an object."""
    if not isinstance(value, dict):
        raise ValueError(_err("path", f"holds {file}: {field} must be an object, got {_type_name(value)}"))
    return value


def _check_path(path: object, fn: str = "load_checkpoint_") -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"lowbit.{fn}: path must be a checkpoint directory (str or os.PathLike), got "
                        f"{type(path).__name__}")
    path = Path(path)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"lowbit.{fn}: path is not a checkpoint directory: {path} {what} (lowbit loads "
                                "local directories; download a Hub checkpoint first, e.g. with "
                                "huggingface_hub.snapshot_download)")
    return path


def checkpoint_format(path: str | Path) -> str | None:
    """The quantization a checkpoint directory declares: ``"modelopt"``
    (``hf_quant_config.json``, or config.json's ``quantization_config``
    with ``quant_method`` modelopt), ``"compressed-tensors"``, or None when
    it declares none. Raises ValueError for any quantization other than
    NVFP4 with 16-element groups, and for a malformed config (not JSON,
    fields missing or of the wrong type), naming the file and field."""
    path = Path(path)
    hf_quant = path / "hf_quant_config.json"
    if hf_quant.is_file():
        top = _object(_read_json(hf_quant), hf_quant, "its top level")
        if "quantization" not in top:
            raise ValueError(_err("path", f"holds {hf_quant}: 'quantization' is missing (ModelOpt writes "
                                          "{\"quantization\": {\"quant_algo\": \"NVFP4\", ...}})"))
        _check_modelopt(_object(top["quantization"], hf_quant, "'quantization'"), hf_quant, "'quantization'")
        return "modelopt"
    config = path / "config.json"
    if not config.is_file():
        return None
    qc = _object(_read_json(config), config, "its top level").get("quantization_config")
    if qc is None:
        return None
    field = "'quantization_config'"
    qc = _object(qc, config, field)
    if not qc:
        return None
    if "quant_method" not in qc:
        raise ValueError(_err("path", f"holds {config}: {field} has no 'quant_method' (e.g. 'modelopt', "
                                      "'compressed-tensors')"))
    method = qc["quant_method"]
    if method == "modelopt":
        _check_modelopt(qc, config, field)
        return "modelopt"
    if method == "compressed-tensors":
        _check_compressed(qc, config, field)
        return "compressed-tensors"
    raise ValueError(_err("path", f"holds a checkpoint quantized with quant_method {method!r} ({config}); lowbit "
                                  "loads NVFP4 checkpoints (ModelOpt, compressed-tensors) only"))


def _check_modelopt(q: dict, file: Path, field: str) -> None:
    where = f"{file} {field}"
    if "quant_algo" not in q:
        raise ValueError(_err("path", f"holds {file}: {field}['quant_algo'] is missing (NVFP4 expected)"))
    algo = q["quant_algo"]
    if algo == "MIXED_PRECISION":
        layers = _object(q.get("quantized_layers"), file, f"{field}['quantized_layers']")
        algos = {_object(layer, file, f"{field}['quantized_layers'][{name!r}]").get("quant_algo")
                 for name, layer in layers.items()}
    else:
        algos = {algo}
    if algos != {"NVFP4"}:
        raise ValueError(_err("path", f"holds a ModelOpt checkpoint with quant_algo {sorted(map(str, algos))} "
                                      f"({where}); lowbit loads NVFP4 only"))
    group_size = q.get("group_size", 16)
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool)):
        raise ValueError(_err("path", f"holds {file}: {field}['group_size'] must be an int, got "
                                      f"{_type_name(group_size)} {group_size!r}"))
    if group_size not in (None, 16):
        raise ValueError(_err("path", f"holds NVFP4 with group_size {group_size} ({where}); NVFP4 is 16"))


def _check_compressed(qc: dict, file: Path, field: str) -> None:
    where = f"{file} {field}"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        got = "an empty one" if isinstance(groups, dict) else _type_name(groups)
        raise ValueError(_err("path", f"holds {file}: {field}['config_groups'] must be a non-empty object, got {got}"))
    for name, group in groups.items():
        group = _object(group, file, f"{field}['config_groups'][{name!r}]")
        fmt = group.get("format", qc.get("format"))
        weights = _object(group.get("weights"), file, f"{field}['config_groups'][{name!r}]['weights']")
        if fmt != "nvfp4-pack-quantized" or weights.get("num_bits") != 4 or weights.get("group_size") != 16:
            raise ValueError(_err(
                "path", f"holds a compressed-tensors checkpoint whose group {name!r} is {fmt!r} with "
                        f"{weights.get('num_bits')}-bit weights in groups of {weights.get('group_size')} ({where}); "
                        "lowbit loads nvfp4-pack-quantized (4 bits, groups of 16) only"))


_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class _Shards:
    """A checkpoint directory's safetensors files: which file holds each
    key, opened lazily, read one tensor at a time onto the device that
    ``place`` gives for its name."""

    def __init__(self, path: Path) -> None:
        try:
            from safetensors import safe_open
        except ImportError as e:  # pragma: no cover - safetensors comes with transformers
            raise ImportError("lowbit.load_checkpoint_ needs the safetensors package (pip install safetensors)") from e
        self._open = safe_open
        self._handles: dict[tuple[Path, str], object] = {}
        self.key_of: dict[str, str] = {}  # the model's name -> the checkpoint's key, when they differ
        self.place: Callable[[str], torch.device] = lambda name: torch.device("cpu")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _object(_object(_read_json(index), index, "its top level").get("weight_map"), index,
                                 "'weight_map'")
            self.file_of = {}
            for key, file in weight_map.items():
                if not isinstance(file, str):
                    raise ValueError(_err("path", f"holds {index}: 'weight_map'[{key!r}] must be a file name, got "
                                                  f"{_type_name(file)}"))
                if not (path / file).is_file():
                    raise FileNotFoundError(_err("path", f"holds {index}, which names {file} (for {key}), which is "
                                                         f"not in {path}"))
                self.file_of[key] = path / file
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(_err("path", f"holds no .safetensors files: {path}"))
            self.file_of = {key: file for file in files for key in self._handle(file, "cpu").keys()}

    def _handle(self, file: Path, device: str):
        if (file, device) not in self._handles:
            self._handles[(file, device)] = self._open(str(file), framework="pt", device=device)
        return self._handles[(file, device)]

    def get(self, name: str) -> Tensor:
        key = self.key_of.get(name, name)
        device = self.place(name)
        return self._handle(self.file_of[key], "cpu" if device.type == "cpu" else str(device)).get_tensor(key)

    def nbytes(self, key: str) -> int:
        """The size of checkpoint tensor ``key``, from the file's header."""
        meta = self._handle(self.file_of[key], "cpu").get_slice(key)
        return math.prod(meta.get_shape()) * _DTYPE_BYTES.get(meta.get_dtype(), 4)

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype of the tensor named ``name`` ("BF16", "U8", ...), from the header."""
        key = self.key_of.get(name, name)
        return self._handle(self.file_of[key], "cpu").get_slice(key).get_dtype()


def _with_index(device: torch.device | str, arg: str = "device") -> torch.device:
    """``device`` (the argument ``arg``) as a torch.device to load onto, a
    CUDA one with its index."""
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise ValueError(_err(arg, f"must be a torch device, got {device!r}"))
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(_err(arg, f"must be a torch device, got {device!r}")) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(_err(arg, f"must be where the tensors are loaded (cpu, cuda), got {device}"))
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(_err(arg, f"is {device}, but there is no CUDA device"))
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise ValueError(_err(arg, f"is {device}, but there are {count} CUDA devices"))
    return device


def _device_of(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return _with_index(device)
    for t in model.parameters():
        if t.device.type != "meta":
            return t.device
    raise ValueError(_err("device", "is required: the model's parameters are on the meta device"))


def _module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


_QUANTIZED_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def _load_tensor(model: nn.Module, name: str, shards: _Shards, keep_dtype: bool = False) -> bool:
    """Loads checkpoint tensor ``name`` into the model's parameter or
    persistent buffer of that name, in the model's dtype for it (with
    ``keep_dtype``, in the checkpoint's); False when the model has none."""
    prefix, _, leaf = name.rpartition(".")
    owner = _module(model, prefix)
    if owner is None:
        return False
    old = owner._parameters.get(leaf)
    is_buffer = old is None and leaf in owner._buffers and leaf not in owner._non_persistent_buffers_set
    if is_buffer:
        old = owner._buffers[leaf]
    if old is None:
        return False
    tensor = shards.get(name)
    if tensor.shape != old.shape:
        raise ValueError(_err("path", f"holds {name} with shape {list(tensor.shape)}; the model's is {list(old.shape)}"))
    if tensor.dtype in _QUANTIZED_DTYPES and old.is_floating_point():
        # Codes without the scales lowbit would need to read them.
        raise ValueError(_err("path", f"holds {name} as {tensor.dtype} without NVFP4 scales; lowbit loads NVFP4 "
                                      "checkpoints (ModelOpt, compressed-tensors) only"))
    # Integers are not cast to floats nor floats to integers: either is a
    # wrong tensor, not a precision to convert.
    if old.is_floating_point() and not tensor.is_floating_point():
        raise ValueError(_err("path", f"holds {name} as {tensor.dtype}; the model's is floating point ({old.dtype})"))
    if not old.is_floating_point() and old.dtype != torch.bool and tensor.is_floating_point():
        raise ValueError(_err("path", f"holds {name} as {tensor.dtype}; the model's is an integer ({old.dtype})"))
    if not keep_dtype:
        tensor = tensor.to(old.dtype)
    if is_buffer:
        owner._buffers[leaf] = tensor
    else:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad and tensor.is_floating_point())
    return True


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


class _Nvfp4Tensors:
    """One NVFP4 module's checkpoint tensors, read as ModelOpt's (weight,
    block scale codes, global = amax / 2688) triple."""

    def __init__(self, prefix: str, leaves: dict[str, str], fmt: str) -> None:
        self.prefix, self.leaves, self.fmt = prefix, leaves, fmt

    def load(self, shards: _Shards, out_features: int, in_features: int) -> tuple[Tensor, Tensor, Tensor]:
        """Checked against the model's layer, ``in_features`` -> ``out_features``."""
        names = _MODELOPT if self.fmt == "modelopt" else _COMPRESSED
        missing = [n for n in names if n not in self.leaves]
        if missing:
            raise ValueError(_err("path", f"holds an NVFP4 {self.prefix} without {self.prefix}.{missing[0]}"))
        weight = shards.get(self.leaves[names[1]])
        if weight.dtype != torch.uint8 or tuple(weight.shape) != (out_features, in_features // 2):
            raise ValueError(_err("path", f"holds {self.leaves[names[1]]} as {weight.dtype} {list(weight.shape)}; the "
                                          f"model's layer is {in_features} -> {out_features}, NVFP4 weight uint8 "
                                          f"[{out_features}, {in_features // 2}]"))
        scale = shards.get(self.leaves[names[2]])
        if scale.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(scale.shape) != (
                out_features, in_features // 16):
            raise ValueError(_err("path", f"holds {self.leaves[names[2]]} as {scale.dtype} {list(scale.shape)}; NVFP4 "
                                          f"block scales of this layer are float8_e4m3fn [{out_features}, "
                                          f"{in_features // 16}]"))
        key = self.leaves[names[0]]
        global_ = shards.get(key)
        if global_.numel() != 1:
            raise ValueError(_err("path", f"holds {key} of shape {list(global_.shape)}; one global "
                                          "scale per tensor was expected"))
        if global_.dtype != torch.float32:
            raise ValueError(_err("path", f"holds {key} as {global_.dtype}; an NVFP4 global scale is float32"))
        global_ = global_.reshape(())
        value = global_.item()
        if self.fmt == "compressed-tensors":
            if not value > 0:  # NaN too
                raise ValueError(_err("path", f"holds {key} = {value}; compressed-tensors' global scale "
                                              "(2688 / amax) is > 0"))
            global_ = global_from_compressed_tensors(global_)
        elif not (math.isfinite(value) and value >= 0):  # 0: an all-zero weight
            raise ValueError(_err("path", f"holds {key} = {value}; an NVFP4 global scale (amax / 2688) is finite "
                                          "and >= 0"))
        return weight, scale.view(torch.uint8), global_


def _group(names: list[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Checkpoint keys of NVFP4 modules by module name ({leaf: key}), and
    the other keys."""
    by_module: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        by_module.setdefault(prefix, {})[leaf] = name
    nvfp4, plain = {}, []
    for prefix, leaves in by_module.items():
        if _MODELOPT[0] in leaves or _COMPRESSED[0] in leaves or _COMPRESSED[1] in leaves:
            nvfp4[prefix] = leaves
        else:
            plain.extend(leaves.values())
    return nvfp4, plain


def load_checkpoint_(
    model: nn.Module,
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    device_map: str | Mapping[str, torch.device | str] | None = None,
    key_map: Callable[[str], str | None] | None = None,
    fp8_min_rows: int | None = None,
    progress: bool = True,
    compute: str = "w4a16",
) -> LoadReport:
    """Loads the NVFP4 checkpoint directory ``path`` (safetensors files,
    sharded or not) into ``model`` in place, replacing its quantized layers
    with lowbit's (see the module docstring). Returns a :class:`LoadReport`.

    ``model``'s parameters may be on the meta device (built without
    memory); every one must then be in the checkpoint. ``device``: where the
    tensors go (default: where the model's parameters are). ``device_map``
    spreads the model over several devices instead, pipeline style:
    ``"auto"`` (the decoder layers over every visible CUDA device, balanced
    by their checkpoint bytes; embeddings on the first, the output head on
    the last) or {module name: device} as transformers takes it (a tensor
    goes where its longest enclosing entry says, ``""`` the default); each
    placed module then moves its inputs to its device, and the model its
    outputs to its input's device. ``key_map``
    renames a checkpoint key to the model's name for it (None drops it),
    for checkpoints named otherwise than the model. ``compute`` (and the
    deprecated ``fp8_min_rows``): as :func:`lowbit.quantize_`, for the
    Linear layers and the MoE blocks, whose FP8 copy (``"auto"``,
    ``"fp8"``) is made as each is loaded; grouped layers stay W4A16 (their
    op has no FP8 path yet).

    Raises ValueError, naming the key, for a tensor whose shape, dtype,
    value or format does not fit the model, a quantized format other than
    NVFP4, model parameters and MoE routing state the checkpoint does not
    hold (see the module docstring), and malformed config files, naming
    the file; FileNotFoundError when ``path`` is not a directory; TypeError
    or ValueError for arguments of the wrong kind (``key_map`` must return
    a non-empty str or None, ``device`` must be cpu or cuda)."""
    from .nn.linear import Nvfp4GroupedLinear, Nvfp4Linear
    from .nn.moe import Nvfp4MoE

    from .nn.linear import resolve_compute

    mode, fp8_rows = resolve_compute("lowbit.load_checkpoint_", compute, fp8_min_rows)
    if key_map is not None and not callable(key_map):
        raise TypeError(_err("key_map", f"must be a callable (checkpoint key -> model name or None), got "
                                        f"{type(key_map).__name__}"))
    path = _check_path(path)
    declared = checkpoint_format(path)
    shards = _Shards(path)
    report = LoadReport()

    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    names: list[str] = []
    renamed: dict[str, str] = {}
    for key in shards.file_of:
        name = key_map(key) if key_map is not None else key
        if name is not None and not isinstance(name, str):
            raise TypeError(_err("key_map", f"must return a str or None, got {type(name).__name__} for {key!r}"))
        if name == "":
            raise ValueError(_err("key_map", f"maps {key!r} to the empty name; return None to drop a key"))
        if name is None or name.rpartition(".")[2] in _UNUSED_SCALES or any(p.search(name) for p in ignore):
            report.ignored.append(key)
            continue
        if name in renamed:
            raise ValueError(_err("key_map", f"maps both {renamed[name]!r} and {key!r} to {name!r}"))
        renamed[name] = key
        names.append(name)
    shards.key_of = {name: key for name, key in renamed.items() if name != key}
    placement = _device_map(model, device, device_map, lambda: {n: shards.nbytes(renamed[n]) for n in names})
    # The default device: the map's "" entry, else its first, else device.
    device = placement.get("", next(iter(placement.values()))) if placement else _device_of(model, device)
    shards.place = place = _placement.placer(placement, device)

    nvfp4, plain = _group(names)
    for name in plain:
        leaf = name.rpartition(".")[2]
        if leaf in _OTHER_FORMATS or leaf == "weight_scale":  # NVFP4's weight_scale comes with its global
            raise ValueError(_err("path", f"holds {name} without an NVFP4 global scale beside it (weight_scale_2 or "
                                          "weight_global_scale): a quantized format other than NVFP4, which lowbit "
                                          "does not load, or an incomplete NVFP4 layer"))
        if shards.dtype_name(name) == "F8_E8M0":
            raise ValueError(_err("path", f"holds {name} in E8M0, the block scales of MXFP4 (the format of "
                                          "DeepSeek's own FP4 releases), which is not NVFP4; lowbit loads NVFP4 "
                                          "checkpoints (ModelOpt, compressed-tensors) only"))
    formats = {}
    for prefix, leaves in nvfp4.items():
        formats[prefix] = "modelopt" if _MODELOPT[0] in leaves else "compressed-tensors"
        if declared is not None and formats[prefix] != declared:
            raise ValueError(_err("path", f"declares a {declared} checkpoint but holds {prefix} in the "
                                          f"{formats[prefix]} format"))

    # MoE blocks with NVFP4 experts, and which NVFP4 modules are theirs.
    blocks: dict[str, dict] = {}
    for prefix in nvfp4:
        m = _EXPERT.match(prefix)
        if m is None:
            continue
        block = _module(model, m["block"])
        if block is not None and Nvfp4MoE.is_hf_block(block):
            experts = blocks.setdefault(m["block"], {})
            experts[(int(m["e"]), _EXPERT_ROLE[m["proj"]])] = prefix
    for entry in placement:
        owner = next((b for b in [*blocks, *nvfp4] if entry.startswith(b + ".")), None)
        if owner is not None:
            raise ValueError(_err("device_map", f"places {entry!r} apart from the rest of {owner}, which becomes one "
                                                "lowbit module; place it whole"))
    in_blocks = {prefix for experts in blocks.values() for prefix in experts.values()}
    in_blocks |= {f"{b}.shared_experts.{p}" for b in blocks for p in _SHARED}
    linears = [p for p in nvfp4 if p not in in_blocks]
    block_of = {prefix: b for b, experts in blocks.items() for prefix in experts.values()}
    block_of.update({f"{b}.shared_experts.{p}": b for b in blocks for p in _SHARED})
    for prefix, leaves in nvfp4.items():
        mod = _module(model, prefix)
        if mod is not None or prefix in block_of:
            # A bias only on a Linear: the grouped layers ignore theirs (as
            # transformers does) and Nvfp4MoE's kernels have none.
            bias = prefix not in block_of and not Nvfp4GroupedLinear.is_hf_grouped(mod)
            _extra_leaves(prefix, leaves, formats[prefix], bias, block_of.get(prefix), shards, renamed, report)
    total = 1 + len(linears) + len(blocks)
    done = 0

    def step(label: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress_bar("lowbit.load_checkpoint_", done, total, label)

    state = model.state_dict(keep_vars=True)
    buffers_before = {n: id(b) for n, b in model.named_buffers() if n in state}
    with torch.no_grad():
        # Plain tensors first: the MoE blocks' routers are read from the model.
        # Those keep the checkpoint's dtype (a float32 correction bias rounded
        # to BF16 would move the expert choices); their blocks are replaced.
        routers = tuple(f"{b}.gate." for b in blocks)
        for name in plain:
            if not _load_tensor(model, name, shards, keep_dtype=name.startswith(routers)):
                report.unused.append(renamed[name])
        _check_routers_loaded(model, buffers_before, report)
        step("unquantized tensors")

        for prefix in linears:
            mod = _module(model, prefix)
            tensors = _Nvfp4Tensors(prefix, nvfp4[prefix], formats[prefix])
            if Nvfp4GroupedLinear.is_hf_grouped(mod):
                layer = Nvfp4GroupedLinear.from_checkpoint(
                    mod.n_groups, *tensors.load(shards, mod.out_features, mod.in_features))
                report.grouped.append(prefix)
            elif isinstance(mod, nn.Linear) and Nvfp4Linear.computes_like(mod):
                bias = shards.get(nvfp4[prefix]["bias"]) if "bias" in nvfp4[prefix] else None
                if (bias is None) != (mod.bias is None):
                    raise ValueError(_err("path", f"holds {prefix} {'with' if bias is not None else 'without'} a "
                                                  f"bias; the model's layer has {'none' if mod.bias is None else 'one'}"))
                if bias is not None and not bias.is_floating_point():
                    raise ValueError(_err("path", f"holds {renamed[nvfp4[prefix]['bias']]} as {bias.dtype}; the "
                                                  f"model's is floating point ({mod.bias.dtype})"))
                if bias is not None:
                    bias = bias.to(mod.bias.dtype if mod.bias.dtype != torch.float32 else torch.bfloat16)
                layer = Nvfp4Linear.from_checkpoint(*tensors.load(shards, mod.out_features, mod.in_features), bias)
                layer._set_compute(mode, fp8_rows)
                report.linear.append(prefix)
            elif mod is None:
                report.unused.extend(renamed[k] for k in nvfp4[prefix].values())
                continue
            else:
                raise ValueError(_err("path", f"holds {prefix} in NVFP4, but the model's {prefix} is a "
                                              f"{type(mod).__name__}, which lowbit has no NVFP4 layer for"))
            _replace(model, prefix, layer)
            step(prefix)

        for name, experts in blocks.items():
            _replace(model, name, _load_moe(model.get_submodule(name), name, experts, nvfp4, formats, shards, mode))
            report.moe.append(name)
            step(name)

    after = dict(model.named_buffers())
    report.not_in_checkpoint = [n for n, i in buffers_before.items() if n in after and id(after[n]) == i]
    _finish(model, place, report)
    if len(set(placement.values())) > 1:
        _placement.dispatch(model, placement)
    return report


def _extra_leaves(prefix: str, leaves: dict[str, str], fmt: str, bias: bool, block: str | None, shards: _Shards,
                  renamed: dict[str, str], report: LoadReport) -> None:
    """The tensors of NVFP4 module ``prefix`` beside its format's three (and
    a Linear's ``bias``): refused where dropping them would change the
    output, reported as ignored (a zero zero-point) or unused otherwise."""
    known = {*(_MODELOPT if fmt == "modelopt" else _COMPRESSED), *(("bias",) if bias else ())}
    for leaf, name in leaves.items():
        if leaf in known:
            continue
        key = renamed[name]
        if leaf == "bias" and block is not None:
            raise ValueError(_err("path", f"holds {key}, a bias of an expert of MoE block {block}; Nvfp4MoE's "
                                          "kernels have no expert bias, and dropping it would change the output"))
        if leaf == "pre_quant_scale":
            raise ValueError(_err("path", f"holds {key}, an AWQ pre-quantization scale of the inputs, which lowbit's "
                                          "NVFP4 layers do not apply; dropping it would change the output"))
        if leaf == "weight_zero_point":
            if shards.get(name).float().count_nonzero().item():
                raise ValueError(_err("path", f"holds {key} with nonzero values: an asymmetric zero point, which "
                                              "NVFP4 (symmetric) does not have"))
            report.ignored.append(key)  # all zeros: what symmetric NVFP4 means anyway
            continue
        report.unused.append(key)


# A router's state that only the checkpoint has: the model's placeholder
# (zeros) would choose the wrong experts (a hash layer: expert 0 for all).
_ROUTER_STATE = ("e_score_correction_bias", "tid2eid")


def _check_routers_loaded(model: nn.Module, buffers_before: dict[str, int], report: LoadReport) -> None:
    from .nn.moe import Nvfp4MoE

    missing = []
    for name, block in model.named_modules():
        gate = getattr(block, "gate", None) if Nvfp4MoE.is_hf_block(block) else None
        if isinstance(gate, nn.Module):
            for leaf in _ROUTER_STATE:
                buf, full = gate._buffers.get(leaf), f"{name}.gate.{leaf}" if name else f"gate.{leaf}"
                if buf is not None and buffers_before.get(full) == id(buf):
                    missing.append(full)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        hint = f"; {len(report.unused)} checkpoint keys had no place in the model, first {report.unused[0]}" \
            if report.unused else ""
        raise ValueError(_err("path", f"does not hold the model's {', '.join(missing[:5])}{more}, MoE routing state "
                                      "that only a checkpoint has (the model's placeholder zeros would choose "
                                      f"the wrong experts){hint}"))


def _device_map(model: nn.Module, device: torch.device | str | None, device_map: object,
                checkpoint_bytes: Callable[[], dict[str, int]]) -> dict[str, torch.device]:
    """{module name: device} for load_checkpoint_'s ``device``/``device_map``."""
    if device_map is None:
        return {}
    if device is not None:
        raise ValueError(_err("device", "and device_map cannot both be given"))
    if device_map == "auto":
        if not torch.cuda.is_available():
            raise ValueError(_err("device_map", "'auto' spreads the model over CUDA devices, and there are none"))
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        nbytes = checkpoint_bytes()
        placement = _placement.auto_device_map(model, nbytes, devices)
        place = _placement.placer(placement, devices[0])
        need_of = dict.fromkeys(devices, 0)
        for name, b in nbytes.items():
            need_of[place(name)] += b
        for d, need in need_of.items():
            free = torch.cuda.mem_get_info(d)[0]
            if need > 0.95 * free:
                raise ValueError(_err("device_map", f"'auto' puts {need / 2**30:.1f} GiB of the checkpoint on {d}, "
                                                    f"which has {free / 2**30:.1f} GiB free"))
        return placement
    out = {}
    for name, d in _placement.checked_device_map(model, device_map).items():
        if d.type not in ("cpu", "cuda"):
            raise ValueError(_err("device_map", f"must place tensors on cpu or cuda, got {d} for {name!r}"))
        out[name] = _with_index(d, f"device_map[{name!r}]")
    return out


def _load_moe(block: nn.Module, name: str, experts: dict, nvfp4: dict, formats: dict, shards: _Shards,
              compute: str) -> nn.Module:
    """An HF MoE block with its NVFP4 experts -> Nvfp4MoE computing as
    ``compute`` says, read from the checkpoint one expert at a time."""
    from .nn.moe import Nvfp4MoE

    n_experts, two_i, h = block.experts.gate_up_proj.shape
    i = two_i // 2
    for e in range(n_experts):
        for role in ("gate", "up", "down"):
            if (e, role) not in experts:
                raise ValueError(_err("path", f"holds NVFP4 experts for {name} but not expert {e}'s {role} "
                                              f"projection ({n_experts} experts expected)"))
    extra = sorted(e for e, _ in experts if e >= n_experts)
    if extra:
        raise ValueError(_err("path", f"holds expert {extra[0]} of {name}, which has {n_experts} experts"))
    for p in _SHARED:
        if f"{name}.shared_experts.{p}" not in nvfp4:
            raise ValueError(_err("path", f"holds {name}'s routed experts in NVFP4 but not its shared expert's "
                                          f"{p}; Nvfp4MoE holds the shared expert in NVFP4 too"))
    if block.gate.weight.device.type == "meta":
        raise ValueError(_err("path", f"does not hold {name}.gate.weight, the router of an NVFP4 MoE block"))

    def load(prefix: str, out_features: int, in_features: int) -> tuple[Tensor, Tensor, Tensor]:
        return _Nvfp4Tensors(prefix, nvfp4[prefix], formats[prefix]).load(shards, out_features, in_features)

    def expert(e: int) -> tuple[Tensor, ...]:
        (gw, gs, gg), (uw, us, ug) = (load(experts[(e, role)], i, h) for role in ("gate", "up"))
        return (torch.cat([gw, uw]), torch.cat([gs, us]), torch.stack([gg, ug]), *load(experts[(e, "down")], h, i))

    shared_i = block.shared_experts.gate_proj.out_features
    shared = {p: load(f"{name}.shared_experts.{p}", *((h, shared_i) if p == "down_proj" else (shared_i, h)))
              for p in _SHARED}
    try:
        return Nvfp4MoE.from_hf_modelopt(block, expert, shared_gate_proj=shared["gate_proj"],
                                         shared_up_proj=shared["up_proj"], shared_down_proj=shared["down_proj"],
                                         compute=compute)
    except ValueError as e:  # e.g. an expert's gate and up with different global scales
        raise ValueError(_err("path", f"holds MoE block {name} that Nvfp4MoE cannot hold: {e}")) from e


def _finish(model: nn.Module, place: Callable[[str], torch.device], report: LoadReport) -> None:
    """Ties the output embedding if the model asks for it, checks that no
    parameter was left unloaded, moves the rest (buffers the checkpoint
    does not hold) where ``place`` says and warns about unused keys and
    buffers left as the model made them."""
    config = getattr(model, "config", None)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(config, "tie_word_embeddings", False) and isinstance(output, nn.Linear) \
            and output.weight.device.type == "meta":
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        hint = f"; {len(report.unused)} checkpoint keys had no place in the model, first {report.unused[0]}" \
            if report.unused else ""
        raise ValueError(_err("path", f"does not hold the model's {', '.join(missing[:5])}{more}{hint}"))
    for name, mod in model.named_modules():
        for leaf, buf in mod._buffers.items():
            target = place(f"{name}.{leaf}" if name else leaf)
            if buf is not None and buf.device != target:
                mod._buffers[leaf] = buf.to(target)
    if report.not_in_checkpoint:
        warnings.warn(f"lowbit.load_checkpoint_: the checkpoint does not hold {len(report.not_in_checkpoint)} of the "
                      f"model's buffers, which keep their values, first: {report.not_in_checkpoint[:3]}",
                      stacklevel=3)
    if report.unused:
        warnings.warn(f"lowbit.load_checkpoint_: {len(report.unused)} checkpoint keys have no place in the model and "
                      f"were not loaded, first: {report.unused[:3]}", stacklevel=3)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device (no
    memory, no initialization) and their buffers where they were created:
    the non-persistent ones (rotary frequencies) are computed from the
    config, not read from checkpoints."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_pretrained(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    device_map: str | Mapping[str, torch.device | str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    key_map: Callable[[str], str | None] | None = None,
    fp8_min_rows: int | None = None,
    progress: bool = True,
    compute: str = "w4a16",
) -> nn.Module:
    """A transformers causal LM built from the NVFP4 checkpoint directory
    ``path`` (its config.json; the model class must be in transformers),
    with lowbit's layers for the quantized ones (:func:`load_checkpoint_`),
    on ``device`` (default: the current CUDA device if there is one, else
    the CPU) or spread over devices by ``device_map`` (``"auto"``: every
    visible GPU), unquantized tensors in ``dtype``, in eval mode.
    ``compute``: ``"w4a16"`` (default), ``"auto"`` or ``"fp8"`` for the
    Linear layers and MoE blocks, as :func:`lowbit.quantize_`
    (``fp8_min_rows``: deprecated); grouped layers stay W4A16."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("lowbit.load_pretrained needs transformers (pip install transformers)") from e
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"lowbit.load_pretrained: dtype must be a floating-point torch.dtype (the unquantized "
                         f"tensors' dtype), got {dtype!r}")
    from .nn.linear import resolve_compute

    resolve_compute("lowbit.load_pretrained", compute, None)  # before anything is built
    path = _check_path(path, "load_pretrained")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"lowbit.load_pretrained: path holds no config.json (the model's transformers "
                                f"config), in {path}; load_checkpoint_ loads into a model you build")
    model_type = _object(_read_json(path / "config.json"), path / "config.json", "its top level").get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"lowbit.load_pretrained: path holds {path / 'config.json'} whose 'model_type' is "
                         f"{model_type!r}; a transformers model type (e.g. 'deepseek_v3') was expected")
    checkpoint_format(path)  # refuses other formats before anything is built
    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # lowbit's layers hold it; transformers would look for its own
    if device is None and device_map is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    load_checkpoint_(model, path, device=device, device_map=device_map, key_map=key_map, fp8_min_rows=fp8_min_rows,
                     progress=progress, compute=compute)
    return model.eval()


class _ShardWriter:
    """Tensors into numbered safetensors files of at most ``max_bytes``
    each (one larger tensor gets a file of its own), and the index."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        from safetensors.torch import save_file

        self._save, self._path, self._max = save_file, path, max_bytes
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._files: list[list[str]] = []

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self._max:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += size

    def _flush(self) -> None:
        self._save(self._pending, str(self._path / f"model-part-{len(self._files):05d}.safetensors"),
                   metadata={"format": "pt"})
        self._files.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        if self._pending or not self._files:
            self._flush()
        n = len(self._files)
        weight_map = {}
        for i, names in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self._path / f"model-part-{i:05d}.safetensors").replace(self._path / final)
            weight_map.update(dict.fromkeys(names, final))
        (self._path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"format": "pt"}, "weight_map": weight_map}, indent=1))


def save_pretrained(model: nn.Module, path: str | Path, *, max_shard_bytes: int = 5 << 30,
                    progress: bool = True) -> None:
    """Writes ``model`` (a transformers model with lowbit's layers, e.g. after
    :func:`lowbit.quantize_` or :func:`load_pretrained`) to the directory
    ``path`` as an NVIDIA ModelOpt NVFP4 checkpoint that
    :func:`load_pretrained` loads back to the same model, bit for bit:
    config.json, ``hf_quant_config.json`` (NVFP4, group 16, the Linear
    layers left unquantized as ``exclude_modules``) and safetensors files
    of at most ``max_shard_bytes`` with their index.

    Nvfp4Linear / Nvfp4GroupedLinear become ``weight``, ``weight_scale``,
    ``weight_scale_2``; an Nvfp4MoE its experts one module per expert, its
    shared expert and its router under transformers' DeepSeek names
    (:meth:`lowbit.nn.Nvfp4MoE.to_hf_modelopt`); every other parameter and
    persistent buffer is written as it is (a tied one once). The layout is
    ModelOpt's, but there are no activation scales (``input_scale``): the
    checkpoint is for W4A16, and engines that run NVFP4 activations (W4A4)
    need a calibrated export."""
    from . import __version__
    from .nn.linear import Nvfp4GroupedLinear, Nvfp4Linear
    from .nn.moe import Nvfp4MoE

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(path, max_shard_bytes)
    exclude: list[str] = []
    done: list[str] = []
    seen: set[int] = set()
    lowbit_modules = [n for n, m in model.named_modules() if isinstance(m, (Nvfp4Linear, Nvfp4GroupedLinear, Nvfp4MoE))]
    with torch.no_grad():
        for name, mod in model.named_modules():
            if any(name.startswith(d + ".") for d in done):
                continue  # inside a lowbit module already written
            join = (lambda leaf: f"{name}.{leaf}") if name else (lambda leaf: leaf)
            if isinstance(mod, (Nvfp4Linear, Nvfp4GroupedLinear, Nvfp4MoE)):
                tensors = mod.to_hf_modelopt() if isinstance(mod, Nvfp4MoE) else mod.to_modelopt()
                for leaf, t in tensors.items():
                    writer.add(join(leaf), t)
                done.append(name)
                if progress:
                    progress_bar("lowbit.save_pretrained", len(done), len(lowbit_modules), name)
                continue
            if isinstance(mod, nn.Linear):
                exclude.append(name)
            owned = [*mod._parameters.items(),
                     *((k, b) for k, b in mod._buffers.items() if k not in mod._non_persistent_buffers_set)]
            for leaf, t in owned:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    writer.add(join(leaf), t)
    writer.finish()
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(path)
    (path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "lowbit", "version": __version__},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                         "exclude_modules": exclude},
    }, indent=1))
