"""Registry of transforms by name, descriptor parsing and the encode/decode chains."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import IO, Any, TypeVar

from extensions._compat import TorchExtensionRegistry
from extensions.base import (
    Frame,
    FrameDecoder,
    ItemInfo,
    ReadAt,
    StreamTransformExtension,
    stage_for,
)
from extensions.errors import CheckpointStorageError, UnknownTransformError, printable, quote

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dcp_storage.transforms"
T = TypeVar("T", bound=type)


def parse_descriptor(descriptor: str) -> tuple[str, str]:
    """Split ``"name/version[;config]"`` into ``(name, "version[;config]")``."""
    name, _, version = descriptor.partition("/")
    return name, version


@dataclass(frozen=True)
class Framing:
    """A recorded chain that splits into independent frames (the contract's
    ``frame_decoder`` / ``frames`` capability of its one stage): ``frames(read_at,
    length)`` lists one item's frames (``None`` when it has no list), ``decode`` decodes
    one frame."""

    frames: Callable[[ReadAt, int], Sequence[Frame] | None]
    decode: FrameDecoder


class ExtensionRegistry:
    """Maps registry names to transform classes.

    A new registry holds the built-ins (``stream.zstd``, encryption, byte-shuffle) plus
    everything registered globally with :func:`register` or advertised by installed
    packages under the ``dcp_storage.transforms`` entry-point group. The installed
    packages are scanned only when a name is not otherwise known (or all names are
    listed), once per process: loading a checkpoint of built-in transforms never pays
    for the scan. Registering a different class under a name that is taken raises
    ``ValueError``.

    ``fallback`` is a torch ``ExtensionRegistry``
    (``torch.distributed.checkpoint._extension``): descriptors whose name this registry
    does not know are built through its ``from_descriptor_list``, so transforms
    registered with torch's registry decode here too. Our own names win.
    """

    def __init__(self, transforms: Iterable[type] | None = None, *, fallback: Any = None) -> None:
        self._classes: dict[str, type] = dict(_known_classes())
        self._complete = False
        self._fallback = fallback
        self._framings: dict[tuple[str, ...], Framing | None] = {}
        for cls in transforms or ():
            self.register(cls)

    def register(self, cls: T) -> T:
        name = cls.registry_name()  # type: ignore[attr-defined]
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"transform {cls.__qualname__} has an invalid registry_name {name!r}")
        existing = self._classes.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"transform name {name!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}; pick a namespaced name "
                "such as 'yourorg.codec'"
            )
        self._classes[name] = cls
        self._framings.clear()
        return cls

    def _add_plugins(self) -> None:
        if not self._complete:
            _load_entry_points()
            for name, cls in _known_classes().items():
                self._classes.setdefault(name, cls)  # what this registry holds wins
            self._complete = True

    def names(self) -> list[str]:
        self._add_plugins()
        return sorted(self._classes)

    def get(self, name: str) -> type:
        if name not in self._classes:
            self._add_plugins()
        try:
            return self._classes[name]
        except KeyError:
            raise UnknownTransformError(
                f"unknown transform {quote(name)}; registered: {', '.join(self.names())}. "
                "Register it with extensions.register(YourTransform) or pass "
                "registry=ExtensionRegistry([YourTransform]) to the reader."
            ) from None

    def decoder(self, descriptor: str, item: ItemInfo | None = None) -> Any:
        """Build the transform that decodes one descriptor of ``item``."""
        name, version = parse_descriptor(descriptor)
        info = item or ItemInfo()
        try:
            if name not in self._classes:
                self._add_plugins()
            if name not in self._classes and self._fallback is not None:
                return self._fallback.from_descriptor_list([descriptor])[0]
            cls = self.get(name)
            if issubclass(cls, StreamTransformExtension):
                return cls.decoder_for(version, info)
            return cls.from_descriptor(version)  # type: ignore[attr-defined]
        except CheckpointStorageError:
            raise
        except (ValueError, KeyError) as exc:
            raise UnknownTransformError(
                f"{info.checkpoint}: item {quote(info.item)}: cannot decode descriptor "
                f"{quote(descriptor)}: {printable(str(exc), 200)}. If the metadata is "
                "intact, a newer dcp-storage or the transform's plugin may be needed."
            ) from exc

    def from_descriptor_list(self, descriptors: Sequence[str]) -> list[Any]:
        """torch-compatible: one transform per descriptor, in the given order."""
        return [self.decoder(d) for d in descriptors]

    def decoding_stream(
        self, descriptors: Sequence[str], raw: IO[bytes], item: ItemInfo
    ) -> IO[bytes]:
        """Wrap ``raw`` (stored bytes) so reading it yields the original bytes.

        ``descriptors`` are in the stored (application) order; decoding undoes them in
        reverse, so the last transform applied is the first one removed.
        """
        stream = raw
        for descriptor in reversed(descriptors):
            stream = stage_for(self.decoder(descriptor, item), item).transform_from(stream)
        return stream

    # --- what the contract's capabilities say about a recorded chain -----------------

    def authenticated(self, descriptors: Sequence[str]) -> bool:
        """Whether a stage of the chain is ``authenticated`` (AES-256-GCM is)."""
        return any(
            (cls := self._contract_class(parse_descriptor(d)[0])) is not None and cls.authenticated
            for d in descriptors
        )

    def authenticated_names(self) -> list[str]:
        """The registered names of authenticated transforms (for messages)."""
        classes = [(name, self._contract_class(name)) for name in self.names()]
        return [name for name, cls in classes if cls is not None and cls.authenticated]

    def key_ids(self, descriptors: Sequence[str]) -> list[str]:
        """The key ids decoding the chain needs, in order, each once. A descriptor that
        does not parse is skipped: decoding reports it, naming the item."""
        found: list[str] = []
        for descriptor in descriptors:
            name, version = parse_descriptor(descriptor)
            cls = self._contract_class(name)
            try:
                ids = cls.key_ids(version) if cls is not None else ()
            except ValueError:
                continue
            found += [key_id for key_id in ids if key_id not in found]
        return found

    def seal_keys(self, descriptors: Sequence[str], item: ItemInfo) -> dict[str, bytes]:
        """The metadata seal keys, by key id, that an item recorded with ``descriptors``
        requires (the contract's ``seal_key_ids`` and ``seal_key``): empty for a chain
        with no stage that binds items to their save. Keys are looked up as decoding
        would look them up (a missing one raises :class:`MissingKeyError`)."""
        found: dict[str, bytes] = {}
        for descriptor in descriptors:
            name, version = parse_descriptor(descriptor)
            cls = self._contract_class(name)
            try:
                if cls is None or not cls.seal_key_ids(version):
                    continue
            except ValueError:
                continue  # decoding reports it, naming the item
            sealed = stage_for(self.decoder(descriptor, item), item).seal_key()
            if sealed is not None:
                found.setdefault(*sealed)
        return found

    def max_expansion(self, descriptors: Sequence[str]) -> int | None:
        """The most plain bytes one stored byte of an item recorded with ``descriptors``
        can decode to: the product of its stages' ``max_expansion`` (1 for no stage);
        ``None`` where a stage's is unknown (a transform offering none, one not
        registered, a descriptor it refuses)."""
        bound = 1
        for descriptor in descriptors:
            name, version = parse_descriptor(descriptor)
            cls = self._contract_class(name)
            try:
                stage = cls.max_expansion(version) if cls is not None else None
            except ValueError:
                stage = None
            if not isinstance(stage, int) or stage < 1:
                return None
            bound *= stage
        return bound

    def framing(self, descriptors: Sequence[str]) -> Framing | None:
        """The frames of items recorded with ``descriptors``, when the chain is one
        stage that offers them (the contract's ``frame_decoder`` and ``frames``), else
        ``None``: such items decode as one stream. Answered once per chain."""
        chain = tuple(descriptors)
        if chain in self._framings:
            return self._framings[chain]
        found: Framing | None = None
        if len(chain) == 1:
            name, version = parse_descriptor(chain[0])
            cls = self._contract_class(name)
            try:
                decode = cls.frame_decoder(version) if cls is not None else None
            except ValueError:
                decode = None
            if cls is not None and decode is not None:
                found = Framing(functools.partial(cls.frames, version), decode)
        self._framings[chain] = found
        return found

    def _contract_class(self, name: str) -> type[StreamTransformExtension] | None:
        """The class registered as ``name`` when it subclasses the contract (a class
        offering torch's API only has none of its capabilities), else ``None``."""
        if name not in self._classes:
            self._add_plugins()
        cls = self._classes.get(name)
        return cls if isinstance(cls, type) and issubclass(cls, StreamTransformExtension) else None


def as_registry(registry: Any) -> ExtensionRegistry:
    """``registry`` as one of ours: ``None`` gives the default registry, and torch's own
    ``ExtensionRegistry`` becomes the fallback of a default one."""
    if registry is None:
        return ExtensionRegistry()
    if isinstance(registry, ExtensionRegistry):
        return registry
    if TorchExtensionRegistry is not None and isinstance(registry, TorchExtensionRegistry):
        return ExtensionRegistry(fallback=registry)
    raise TypeError(
        "registry must be an extensions.ExtensionRegistry or torch's "
        f"torch.distributed.checkpoint._extension.ExtensionRegistry, got {registry!r}"
    )


def encoding_stream(
    transforms: Sequence[Any], output: IO[bytes], item: ItemInfo
) -> tuple[IO[bytes], list[str]]:
    """Chain ``transforms`` (application order) in front of ``output``.

    Returns the writer to write plain bytes into and the descriptors to record, in
    application order. Closing the writer closes every stage, outermost first.
    """
    stages = [stage_for(transform, item) for transform in transforms]
    stream = output
    for stage in reversed(stages):
        stream = stage.transform_to(stream)
    return stream, [stage.get_descriptor() for stage in stages]


def chain_descriptors(transforms: Sequence[Any], item: ItemInfo) -> list[str]:
    """The descriptors ``transforms`` record for ``item``, in application order, without
    encoding anything (an incremental save compares them with a base item's)."""
    return [stage_for(transform, item).get_descriptor() for transform in transforms]


def chain_seal_keys(transforms: Sequence[Any], item: ItemInfo) -> dict[str, bytes]:
    """The metadata seal keys, by key id, under which a writer using ``transforms`` for
    ``item`` (of a save: ``item.save`` set) seals its checkpoint's metadata."""
    found: dict[str, bytes] = {}
    for transform in transforms:
        stage = stage_for(transform, item)
        sealed = stage.seal_key() if isinstance(stage, StreamTransformExtension) else None
        if sealed is not None:
            found.setdefault(*sealed)
    return found


_global: dict[str, type] = {}
_lock = threading.Lock()
# Held for the whole entry-point scan, so a registry built while another thread scans
# waits for the plugins instead of missing them; re-entrant for a plugin that builds a
# registry while it is being imported.
_scan_lock = threading.RLock()
_entry_points_loaded = False
_entry_points_scanning = False


def register(cls: T) -> T:
    """Register ``cls`` for every reader in this process; usable as a decorator."""
    name = cls.registry_name()  # type: ignore[attr-defined]
    with _lock:
        existing = _global.get(name) or _builtin_classes().get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"transform name {name!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}; pick a namespaced name "
                "such as 'yourorg.codec'"
            )
        _global[name] = cls
    return cls


def _builtin_classes() -> dict[str, type]:
    from extensions.zstd import ZStandard

    classes: list[type] = [ZStandard]
    try:
        from extensions.encryption import AES256GCM

        classes.append(AES256GCM)
    except ImportError:  # the cryptography package is optional until used
        pass
    try:
        from extensions.shuffle import ByteShuffle
        from extensions.weights import WeightCodec

        classes += [ByteShuffle, WeightCodec]
    except ImportError:  # numpy is a core dependency; kept optional like the others
        pass
    return {c.registry_name(): c for c in classes}  # type: ignore[attr-defined]


def _load_entry_points() -> None:
    """Register the installed plugins, once per process (the scan costs ~26 ms)."""
    global _entry_points_loaded, _entry_points_scanning
    if _entry_points_loaded:
        return
    with _scan_lock:
        if _entry_points_loaded or _entry_points_scanning:
            return  # done by another thread, or re-entered from a plugin's import
        _entry_points_scanning = True
        try:
            for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
                try:
                    cls = ep.load()
                except Exception as exc:  # a broken plugin must not break loading others
                    log.warning("cannot load transform plugin %s: %s", ep.value, exc)
                    continue
                try:
                    register(cls)
                except ValueError as exc:
                    log.warning("transform plugin %s ignored: %s", ep.value, exc)
            # Only now: a thread that sees the flag must also see every plugin.
            _entry_points_loaded = True
        finally:
            _entry_points_scanning = False


def _known_classes() -> dict[str, type]:
    """Built-ins and what was registered (plugins too, once scanned)."""
    classes = _builtin_classes()
    with _lock:
        classes.update(_global)
    return classes
