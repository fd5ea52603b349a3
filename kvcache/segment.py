"""The SSD tier's file format: pure functions, no state.

    encode(namespace, blocks) -> bytes            one safetensors segment of up to SEGMENT_BLOCKS blocks
    verified_blocks(raw, namespace) -> ({hash: tensors}, problem)   XXH3-128 checked, up to the first bad block
    decode(raw, namespace, wanted) -> ([SpillRequest], problem)      the same, with each block's description
    write_atomically(path, payload)               temp file in the same folder, fsync, os.replace
    describe(path, namespace)                     a segment's blocks and owners from its header alone
    seal(sealer, namespace, request) -> SpillRequest   the block's tensors as one sealed blob (its tenant's key)
    unseal(sealer, namespace, raw, blocks) -> {hash: tensors}   the same blocks opened, up to the first that does not

A segment is a safetensors file: tensors named "<block hash hex>/<tensor name>", and metadata with the
format version, the namespace (model fingerprint, block size, quantisation), and per block its hash,
parent hash, token count, tenant scope, owners when written, and checksum. A reader sees a whole
file or none: a torn file can only be a temp file (".tmp-*"), never a segment name.

Encryption at rest: a sealed block is one uint8 tensor "<hash>/sealed" (AES-256-GCM under its
tenant's data key, bound to the namespace and block hash), its metadata naming the tenant whose key
sealed it and the layout (name, dtype, shape) of the tensors inside. The checksum covers the sealed
bytes, so corruption is told apart from a shredded key without any key.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import xxhash
from safetensors.numpy import save as save_tensors

from .sealing import Sealer

FORMAT_VERSION = "2"
SEGMENT_BLOCKS = 16  # blocks spilled together share a file: reads within 2x of the raw disk (docs/caches.md)
PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600  # blocks hold tenants' prompts: owner-only
TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class SpillRequest:
    block_hash: bytes
    parent_hash: bytes
    num_tokens: int
    tenant_scope: str
    tensors: dict[str, np.ndarray] = field(repr=False)
    owners: tuple[str, ...] = ()  # opaque owner labels (the index keeps them current; the file, for reindexing)
    tenant: str = ""  # whose data key seals the block (PUBLIC_TENANT: a declared public prefix's)
    layout: str = ""  # sealed: JSON [[name, dtype, shape], ...] of the tensors in tensors["sealed"]; "": plain


def encode(namespace: str, requests: list[SpillRequest]) -> bytes:
    described, tensors = [], {}
    for request in requests:
        hex_hash = request.block_hash.hex()
        described.append(
            {
                "hash": hex_hash,
                "parent": request.parent_hash.hex(),
                "num_tokens": request.num_tokens,
                "scope": request.tenant_scope,
                "owners": list(request.owners),
                "checksum": tensor_checksum(request.tensors),
                "tenant": request.tenant,
                "layout": request.layout,
            }
        )
        tensors.update({f"{hex_hash}/{key}": value for key, value in request.tensors.items()})
    metadata = {"format_version": FORMAT_VERSION, "namespace": namespace, "blocks": json.dumps(described)}
    return save_tensors(tensors, metadata=metadata)


def verified_blocks(
    raw: bytes, namespace: str, wanted: list[str] | None = None
) -> tuple[dict[str, dict[str, np.ndarray]], str | None]:
    """The blocks of a segment (the `wanted` ones in order, or all), each checksum-verified, up to the
    first that fails; and what failed (None: nothing). Unreadable files and other formats or
    namespaces fail before any block."""
    try:
        tensors, meta = parse(raw)
        described = {block["hash"]: block for block in json.loads(meta.get("blocks", "[]"))}
    except Exception as exc:  # noqa: BLE001 - JSON, header and dtype errors alike mean unreadable
        return {}, f"unreadable: {type(exc).__name__}"
    if meta.get("format_version") != FORMAT_VERSION or meta.get("namespace") != namespace:
        return {}, "another format or namespace"
    by_block: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        block, _, tensor = key.partition("/")
        by_block.setdefault(block, {})[tensor] = value
    verified: dict[str, dict[str, np.ndarray]] = {}
    for hex_hash in described if wanted is None else wanted:
        mine = by_block.get(hex_hash, {})
        if hex_hash not in described or described[hex_hash]["checksum"] != tensor_checksum(mine):
            return verified, f"checksum mismatch in block {hex_hash[:12]}"
        verified[hex_hash] = mine
    return verified, None


def decode(raw: bytes, namespace: str, wanted: list[str]) -> tuple[list[SpillRequest], str | None]:
    """The wanted blocks as spill requests again (to rewrite a segment without some of its blocks)."""
    blocks, problem = verified_blocks(raw, namespace, wanted)
    described = {block["hash"]: block for block in json.loads(parse(raw)[1]["blocks"])} if blocks else {}
    return [
        SpillRequest(
            bytes.fromhex(h),
            bytes.fromhex(described[h]["parent"]),
            described[h]["num_tokens"],
            described[h]["scope"],
            tensors,
            tuple(described[h].get("owners", ())),
            described[h].get("tenant", ""),
            described[h].get("layout", ""),
        )
        for h, tensors in blocks.items()
    ], problem


def seal(sealer: Sealer, namespace: str, request: SpillRequest) -> SpillRequest:
    """The request with its tensors sealed under its tenant's key, as one uint8 tensor."""
    names = sorted(request.tensors)
    arrays = [np.ascontiguousarray(request.tensors[name]) for name in names]
    layout = json.dumps([[name, a.dtype.str, list(a.shape)] for name, a in zip(names, arrays)])
    plaintext = b"".join(a.data.cast("B") for a in arrays)
    sealed = sealer.seal(request.tenant, _place(namespace, request.block_hash.hex()), plaintext)
    return replace(request, tensors={"sealed": np.frombuffer(sealed, dtype=np.uint8)}, layout=layout)


def unseal(
    sealer: Sealer, namespace: str, raw: bytes, blocks: dict[str, dict[str, np.ndarray]]
) -> tuple[dict[str, dict[str, np.ndarray]], str | None]:
    """Verified blocks (in order) with the sealed ones opened, up to the first that does not open
    (its tenant's key shredded, or sealed for another tenant); and why it did not (None: all did)."""
    described = {block["hash"]: block for block in json.loads(parse(raw)[1]["blocks"])}
    opened: dict[str, dict[str, np.ndarray]] = {}
    for hex_hash, tensors in blocks.items():
        block = described[hex_hash]
        if not block.get("layout"):
            opened[hex_hash] = tensors
            continue
        try:
            plaintext = sealer.open(block.get("tenant", ""), _place(namespace, hex_hash), tensors["sealed"].data)
        except Exception as exc:  # noqa: BLE001 - a shredded key, another tenant's, a key store out of reach
            return opened, f"{type(exc).__name__}: {exc}"
        opened[hex_hash] = _tensors(plaintext, json.loads(block["layout"]))
    return opened, None


def plain_nbytes(request: SpillRequest) -> int:
    """The bytes of the block's tensors in RAM (sealed or not)."""
    if not request.layout:
        return sum(t.nbytes for t in request.tensors.values())
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _, dtype, shape in json.loads(request.layout))


def _tensors(plaintext: bytes, layout: list) -> dict[str, np.ndarray]:
    tensors, offset = {}, 0
    for name, dtype, shape in layout:
        array = np.frombuffer(plaintext, dtype=np.dtype(dtype), count=int(np.prod(shape)), offset=offset)
        tensors[name] = array.reshape(shape)
        offset += array.nbytes
    return tensors


def _place(namespace: str, hex_hash: str) -> bytes:
    return f"kv|{namespace}|{hex_hash}".encode()


def described_owners(raw: bytes) -> dict[str, tuple[str, ...]]:
    """hash -> the owners a segment's metadata records (files written before owners: none)."""
    return {block["hash"]: tuple(block.get("owners", ())) for block in json.loads(parse(raw)[1]["blocks"])}


def describe(path: Path, namespace: str) -> tuple[dict[str, int], dict[str, tuple[str, ...]]] | None:
    """A segment file's blocks from its header alone (hash -> tensor bytes, hash -> owners); None when
    the header is unreadable or of another format or namespace. Blocks are verified when read."""
    try:
        with open(path, "rb") as file:
            header_len = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(header_len)) if 0 < header_len < 1 << 24 else None
        if not isinstance(header, dict):
            return None
        metadata = header.pop("__metadata__")
        if metadata.get("format_version") != FORMAT_VERSION or metadata.get("namespace") != namespace:
            return None
        sizes: dict[str, int] = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            sizes[name.partition("/")[0]] = sizes.get(name.partition("/")[0], 0) + end - begin
        described = json.loads(metadata["blocks"])
        return (
            {block["hash"]: sizes.get(block["hash"], 0) for block in described},
            {block["hash"]: tuple(block.get("owners", ())) for block in described},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_atomically(path: Path, payload: bytes) -> None:
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    temp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE), "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def tensor_checksum(tensors: dict[str, np.ndarray]) -> str:
    """XXH3-128 over names, dtypes, shapes and bytes: it detects torn and flipped files at ~10 GB/s
    (SHA-256 took 8x longer per block read). It guards against corruption, not against an attacker
    who can write the data dir, who could rewrite the checksum as well."""
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.data.cast("B"))
    return digest.hexdigest()


_DTYPES = {"F32": np.float32, "F16": np.float16, "U32": np.uint32, "I32": np.int32, "U16": np.uint16, "U8": np.uint8}


def parse(raw: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """A safetensors file's tensors (zero-copy views of `raw`) and metadata; raises ValueError."""
    header_len = int.from_bytes(raw[:8], "little")
    if header_len <= 0 or 8 + header_len > len(raw):
        raise ValueError("bad safetensors header length")
    header = json.loads(raw[8 : 8 + header_len])
    metadata = header.pop("__metadata__", {})
    base, tensors = 8 + header_len, {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        begin, end = info["data_offsets"]
        if dtype is None or base + end > len(raw):
            raise ValueError(f"tensor {name} is truncated or of an unknown dtype")
        tensors[name] = np.frombuffer(
            raw, dtype=dtype, count=(end - begin) // np.dtype(dtype).itemsize, offset=base + begin
        ).reshape(info["shape"])
    return tensors, metadata
