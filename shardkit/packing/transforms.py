"""Opt-in pack-time image transforms: re-encode, resize, BGR->RGB, pre-decode to ``.npy``; and
the identity of any transform.

Applied inside pack tasks to every image field of a sample. Pre-decoding stores uint8
HxWxC arrays so training skips JPEG decode entirely (more bytes, no decode CPU).

A transform's identity (:func:`describe_transform`) is part of a pack's plan id, so it must be
the same in every process that runs the same code: a rerun after a kill resumes the pack only
if its plan id is unchanged. A :class:`ImageTransform` or any object with ``describe()`` names
itself; :func:`named_transform` gives a callable a name of the user's; any other callable is
identified by its qualified name and a digest of its code (bytecode, constants and names,
nested functions included), its defaults and the values it closes over, never by ``repr``,
which holds a memory address. Module globals the code reads are not part of the digest: name
the transform (and change the name) when such a global changes what it does.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
import types
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
from PIL import Image

from shardkit.errors import ConfigError, SourceError
from shardkit.format.fields import PACK_IMAGE_EXTS
from shardkit.packing.sample import PackSample, StreamedField

__all__ = ["ImageTransform", "NamedTransform", "describe_transform", "named_transform", "transform_from_options"]

_IMAGE_FIELDS = PACK_IMAGE_EXTS  # the fields a transform re-encodes
_FORMATS = {"jpeg": ("JPEG", "jpg"), "jpg": ("JPEG", "jpg"), "webp": ("WEBP", "webp"), "png": ("PNG", "png")}


@dataclass(frozen=True)
class ImageTransform:
    """Re-encode (``reencode="jpeg:90"``), resize (shorter side), swap BGR->RGB, or pre-decode.

    Attributes:
        reencode: ``jpeg[:Q]``, ``webp[:Q]`` or ``png``.
        resize: the shorter side to resize to, in pixels.
        bgr_to_rgb: swap the channels of 3-channel images.
        predecode: store images decoded, as uint8 HxWxC ``.npy``.

    Raises:
        ConfigError: a bad format or size, or ``predecode`` with ``reencode``.
    """

    reencode: str | None = None
    resize: int | None = None
    bgr_to_rgb: bool = False
    predecode: bool = False

    def __post_init__(self) -> None:
        if self.reencode is not None:
            fmt, _, q = self.reencode.partition(":")
            if fmt.lower() not in _FORMATS or (q and not q.isdigit()):
                raise ConfigError(f"--reencode: expected jpeg[:Q], webp[:Q] or png, got {self.reencode!r}")
        if self.resize is not None and self.resize < 1:
            raise ConfigError(f"--resize: expected a positive shorter side, got {self.resize}")
        if self.predecode and self.reencode:
            raise ConfigError("--predecode and --reencode exclude each other")

    def describe(self) -> dict[str, Any]:
        """Describe the transform for dataset.json.

        Returns:
            The options that are set (falsy ones left out), by name.
        """
        return {k: v for k, v in asdict(self).items() if v}

    def __call__(self, sample: PackSample) -> PackSample:
        """Apply the transform to every image field of ``sample``.

        Args:
            sample: the sample as its source loaded it.

        Returns:
            A new sample (an image field may change its name: ``x.png`` -> ``x.npy``).

        Raises:
            SourceError: an image field is no readable image.
        """
        fields = dict(sample.fields)
        for name in [n for n in fields if n.rsplit(".", 1)[-1].lower() in _IMAGE_FIELDS]:
            value = fields.pop(name)
            if isinstance(value, StreamedField):
                value = b"".join(value.chunks())
            new_name, data = self._apply(name, value, sample.key)
            fields[new_name] = data
        return PackSample(sample.key, fields, sample.meta)

    def _apply(self, name: str, data: bytes, key: str) -> tuple[str, bytes]:
        try:
            img: Image.Image = Image.open(io.BytesIO(data))
            img.load()
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for corrupt images
            raise SourceError(f"sample {key!r}: field {name!r} is not a readable image: {exc}") from exc
        if img.mode not in ("RGB", "L"):
            img = img.convert("RGB")
        if self.resize:
            w, h = img.size
            scale = self.resize / min(w, h)
            img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)
        if self.bgr_to_rgb and img.mode == "RGB":
            r, g, b = img.split()
            img = Image.merge("RGB", (b, g, r))
        stem = name.rsplit(".", 1)[0] if "." in name else ""
        prefix = f"{stem}." if stem else ""
        if self.predecode:
            buf = io.BytesIO()
            np.save(buf, np.asarray(img), allow_pickle=False)
            return f"{prefix}npy", buf.getvalue()
        if self.reencode or self.resize or self.bgr_to_rgb:
            fmt, _, q = (self.reencode or "").partition(":")
            pil_fmt, ext = _FORMATS.get(fmt.lower(), _FORMATS["png" if name.endswith("png") else "jpeg"])
            buf = io.BytesIO()
            img.save(buf, pil_fmt, **({"quality": int(q)} if q else {}))
            return f"{prefix}{ext}", buf.getvalue()
        return name, data


def transform_from_options(*, reencode: str | None = None, resize: int | None = None, bgr_to_rgb: bool = False,
                           predecode: bool = False) -> ImageTransform | None:
    """The transform the CLI's options ask for, or None when they ask for none.

    Args:
        reencode: ``--reencode``.
        resize: ``--resize``.
        bgr_to_rgb: ``--bgr-to-rgb``.
        predecode: ``--predecode``.

    Returns:
        The transform, or None.

    Raises:
        ConfigError: as :class:`ImageTransform`.
    """
    if not (reencode or resize or bgr_to_rgb or predecode):
        return None
    return ImageTransform(reencode, resize, bgr_to_rgb, predecode)


@dataclass(frozen=True)
class NamedTransform:
    """A callable transform under a name of the user's, which is then its identity.

    Attributes:
        name: the name (change it when what the transform does changes).
        fn: the callable, applied to each :class:`~shardkit.packing.sample.PackSample`.
    """

    name: str
    fn: Callable[[PackSample], PackSample]

    def describe(self) -> dict[str, Any]:
        """Describe the transform for dataset.json and the plan id.

        Returns:
            ``{"name": name}``.
        """
        return {"name": self.name}

    def __call__(self, sample: PackSample) -> PackSample:
        """Apply ``fn``.

        Args:
            sample: the sample as its source loaded it.

        Returns:
            What ``fn`` returns.
        """
        return self.fn(sample)


def named_transform(name: str, fn: Callable[[PackSample], PackSample]) -> NamedTransform:
    """Give a transform a name that is its identity (instead of a digest of its code).

    Args:
        name: a non-empty name, e.g. ``"resize-224-v2"``.
        fn: the transform.

    Returns:
        The named transform, to pass as ``pack(..., transform=...)``.

    Raises:
        ConfigError: an empty name, or ``fn`` not callable.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"named_transform: the name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ConfigError(f"named_transform: {type(fn).__name__} is not callable")
    return NamedTransform(name, fn)


def describe_transform(transform: Any) -> dict[str, Any]:
    """The identity of a transform, as dataset.json records it and the plan id hashes it:
    equal in every process for the same code (see the module docstring).

    Args:
        transform: None, an object with ``describe()``, or any callable.

    Returns:
        ``{}`` for None; ``describe()``'s result; else ``{"callable": <qualified name>,
        "code": <digest>}``.

    Raises:
        ConfigError: ``transform`` is not callable.
    """
    if transform is None:
        return {}
    describe = getattr(transform, "describe", None)
    if callable(describe) and not isinstance(transform, type):
        return dict(describe())
    if not callable(transform):
        raise ConfigError(f"transform: {type(transform).__name__} is not callable")
    h = hashlib.sha256()
    _feed(h, transform, 0, set())
    return {"callable": _qualified(transform), "code": h.hexdigest()[:16]}


def _qualified(obj: Any) -> str:
    target = obj.func if isinstance(obj, functools.partial) else obj
    if not isinstance(target, (types.FunctionType, types.MethodType, type, types.BuiltinFunctionType)):
        target = type(target)
    return f"{getattr(target, '__module__', None) or '?'}.{getattr(target, '__qualname__', type(target).__name__)}"


_MAX_DEPTH = 8  # nested functions, partials, containers: deep enough for real code, no cycles


def _feed(h: Any, obj: Any, depth: int, seen: set[int]) -> None:
    """Add a stable description of ``obj`` (a callable, a value it uses) to the hash ``h``;
    ``seen`` holds the functions and objects fed already (recursion, shared helpers)."""
    def put(tag: str, data: bytes = b"") -> None:
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    if depth > _MAX_DEPTH:
        put("deep")
        return
    if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial)) or not isinstance(
            obj, (type(None), bool, int, float, complex, str, bytes, tuple, list, set, frozenset, dict,
                  types.CodeType, type, types.ModuleType, types.BuiltinFunctionType)):
        if id(obj) in seen:
            put("again", _qualified(obj).encode())
            return
        seen.add(id(obj))
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        put("v", repr(obj).encode("utf-8", "surrogateescape"))
    elif isinstance(obj, (tuple, list, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        put(type(obj).__name__, str(len(items)).encode())
        for item in items:
            _feed(h, item, depth + 1, seen)
    elif isinstance(obj, dict):
        put("dict", str(len(obj)).encode())
        for key in sorted(obj, key=repr):
            _feed(h, key, depth + 1, seen)
            _feed(h, obj[key], depth + 1, seen)
    elif isinstance(obj, types.CodeType):
        put("code", obj.co_code)
        put("names", repr((obj.co_names, obj.co_varnames, obj.co_freevars, obj.co_argcount)).encode())
        _feed(h, obj.co_consts, depth + 1, seen)
    elif isinstance(obj, types.FunctionType):
        put("fn", _qualified(obj).encode())
        _feed(h, obj.__code__, depth + 1, seen)
        _feed(h, (obj.__defaults__, obj.__kwdefaults__), depth + 1, seen)
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        _feed(h, cells, depth + 1, seen)
    elif isinstance(obj, types.MethodType):
        _feed(h, obj.__func__, depth + 1, seen)
        _feed(h, obj.__self__, depth + 1, seen)
    elif isinstance(obj, functools.partial):
        put("partial")
        _feed(h, (obj.func, obj.args, obj.keywords), depth + 1, seen)
    elif isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
        put("named", _qualified(obj).encode() if not isinstance(obj, types.ModuleType) else obj.__name__.encode())
    else:
        _feed_object(h, obj, depth, put, seen)


def _feed_object(h: Any, obj: Any, depth: int, put: Callable[..., None], seen: set[int]) -> None:
    """An instance: its class's ``__call__`` code (if it has one) and its state, by pickle
    when it pickles (arrays, models), else its attributes."""
    put("obj", _qualified(obj).encode())
    call = getattr(type(obj), "__call__", None)
    if isinstance(call, types.FunctionType):
        _feed(h, call, depth + 1, seen)
    try:
        put("pickle", hashlib.sha256(pickle.dumps(obj, protocol=4)).digest())
        return
    except Exception:  # noqa: BLE001 - unpicklable state: described by its attributes instead
        pass
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        _feed(h, state, depth + 1, seen)
    else:
        text = repr(obj)
        put("repr", b"" if " at 0x" in text else text.encode("utf-8", "surrogateescape"))
