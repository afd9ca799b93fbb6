"""PyTorch-facing wrappers of the C kernels.

Each wrapper takes and returns tensors, checks what the C code relies on
(dtype, contiguity, shapes, and every index it follows: see
:mod:`kvserve.kernels.bounds`) and hands raw pointers over. Callers ask
:func:`native_ops` once; it is None when the kernels are unavailable, and
they then keep to their PyTorch path.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.kernels.bounds import (
    check_decode_tables,
    check_float_tensor,
    check_kv_pool,
    check_slot_mapping,
)
from kvserve.kernels.build import load_library

if TYPE_CHECKING:
    from kvserve.worker.decode_stack import DecodeStack

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class WeightKind(enum.IntEnum):
    """How linear weights are stored and multiplied (``KV_WEIGHTS_*`` in kernels.h)."""

    F32 = 0
    BF16_WIDEN = 1  # bfloat16 widened to float32 as it streams: any CPU
    BF16_DOT = 2  # bfloat16 with AVX512-BF16 dot products


class NativeOps:
    """The loaded kernels with their C signatures declared.

    bf16_dot: multiply bfloat16 weights with AVX512-BF16 dot products (None: wherever
    the library was built with them); False keeps the portable kernel that widens
    each weight to float32, which runs on any CPU (tests pin it to compare both).
    """

    def __init__(self, lib: ctypes.CDLL, bf16_dot: bool | None = None) -> None:
        self.lib = lib
        available = bool(lib.kv_has_bf16_dot())
        if bf16_dot and not available:
            raise ValueError("the kernels were built without AVX512-BF16 on this CPU")
        self.bf16_dot = available if bf16_dot is None else bf16_dot
        self._linear_f32 = lib.kv_linear_f32
        self._linear_bf16_widen = lib.kv_linear_bf16w
        for function in (self._linear_f32, self._linear_bf16_widen):
            function.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int]
            function.restype = None
        self._linear_bf16_dot = lib.kv_linear_bf16_dot
        self._linear_bf16_dot.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int]
        self._linear_bf16_dot.restype = ctypes.c_int
        # The kernel each weight dtype goes to, chosen once (linear runs every layer, every step).
        self._linear = {
            torch.float32: self._linear_f32,
            torch.bfloat16: self._linear_bf16_dot if self.bf16_dot else self._linear_bf16_widen,
        }
        self._decode = lib.kv_paged_decode
        self._decode.argtypes = [
            _p,  # query
            _i64,  # query row stride
            _p,  # key cache
            _p,  # value cache
            ctypes.c_int,  # bf16 pool
            _p,  # block tables
            _p,  # seq lens
            _p,  # out
            *[_i64] * 6,
            ctypes.c_float,  # scale
            _i64,  # window (0: none)
            ctypes.c_float,  # soft cap (0: none)
            ctypes.c_int,
        ]
        self._decode.restype = ctypes.c_int
        self._rms_norm = lib.kv_add_rms_norm_f32
        self._rms_norm.argtypes = [_p, _p, _p, _p, _i64, _i64, ctypes.c_float, ctypes.c_int]
        self._rms_norm.restype = None
        self._rotary = lib.kv_rotary_f32
        self._rotary.argtypes = [_p, _p, _i64, _i64, _i64, _i64, ctypes.c_int]
        self._rotary.restype = None
        self._silu_mul = lib.kv_silu_mul_f32
        self._silu_mul.argtypes = [_p, _p, _i64, _i64, ctypes.c_int]
        self._silu_mul.restype = None
        self._write_cache = lib.kv_write_cache
        self._write_cache.argtypes = [
            _p,
            _p,
            _p,
            _p,
            ctypes.c_int,  # bf16 pool
            _p,
            _i64,
            _i64,
            _i64,
            _i64,
            ctypes.c_int,
        ]
        self._write_cache.restype = None
        self._decode_layers = lib.kv_decode_layers
        self._decode_layers.argtypes = [
            _p,  # layers
            _i64,
            _p,
            _p,  # residual, out
            ctypes.c_int,  # norm kind
            ctypes.c_int,  # activation kind
            ctypes.c_float,  # eps
            ctypes.c_int,  # weight kind
            ctypes.c_int,  # bf16 pool
            *[_p] * 5,  # rope tables, slot mappings, block tables, max blocks (per group), seq_lens
            *[_i64] * 7,  # block_size, T, hidden, heads, kv heads, head_dim, intermediate
            ctypes.c_int,  # threads
        ]
        self._decode_layers.restype = ctypes.c_int
        self._layer_norm = lib.kv_add_layer_norm_f32
        self._layer_norm.argtypes = [_p, _p, _p, _p, _p, _i64, _i64, ctypes.c_float, ctypes.c_int]
        self._layer_norm.restype = None
        self._head_rms_norm = lib.kv_head_rms_norm_f32
        self._head_rms_norm.argtypes = [
            _p,
            _p,
            _i64,
            _i64,
            _i64,
            _i64,
            ctypes.c_float,
            ctypes.c_int,
        ]
        self._head_rms_norm.restype = None
        self._gelu_tanh = lib.kv_gelu_tanh_f32
        self._gelu_tanh.argtypes = [_p, _p, _i64, _i64, ctypes.c_int, ctypes.c_int]
        self._gelu_tanh.restype = None

    def weight_kind(self, dtype: torch.dtype) -> WeightKind:
        """How the kernels multiply linear weights of ``dtype`` on this CPU."""
        if dtype == torch.float32:
            return WeightKind.F32
        if dtype == torch.bfloat16:
            return WeightKind.BF16_DOT if self.bf16_dot else WeightKind.BF16_WIDEN
        raise ValueError(f"the linear kernels take float32 or bfloat16 weights, not {dtype}")

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for float32 ``x`` ``[M, K]`` and ``weight`` ``[N, K]``.

        ``weight`` is float32 or bfloat16 (see :meth:`weight_kind`); ``bias``
        and the result are float32.
        """
        x = x.contiguous()
        if x.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError("the linear kernel takes float32 rows and a contiguous weight")
        num_rows, in_features = x.shape
        out_features = weight.shape[0]
        out = torch.empty(num_rows, out_features, dtype=torch.float32)
        function = self._linear.get(weight.dtype)
        if function is None:
            raise ValueError(
                f"the linear kernels take float32 or bfloat16 weights, not {weight.dtype}"
            )
        status = function(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            num_rows,
            in_features,
            out_features,
            torch.get_num_threads(),
        )
        if status:  # only the dot-product kernel reports one
            raise MemoryError("the bf16 linear kernel could not allocate its scratch")
        return out

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """RMSNorm of ``x`` ``[T, D]``, or of ``residual += x`` (in place) when given."""
        x = x.contiguous()
        if residual is not None and not residual.is_contiguous():
            raise ValueError("the residual stream must be contiguous: it is updated in place")
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def rotary_(
        self, x: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_dim: int
    ) -> None:
        """Rotate, in place, the first ``num_heads`` heads of every row of ``x`` ``[T, row]``.

        cos_sin: ``[T, 2, head_dim]``, each row's cosines then sines.
        """
        if not x.is_contiguous() or not cos_sin.is_contiguous():
            raise ValueError("rotary_ needs contiguous rows")
        self._rotary(
            x.data_ptr(),
            cos_sin.data_ptr(),
            x.shape[0],
            num_heads,
            head_dim,
            x.shape[1],
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[T, 2 I]`` holding gate then up; ``[T, I]``."""
        gate_up = gate_up.contiguous()
        num_tokens, width = gate_up.shape
        out = torch.empty(num_tokens, width // 2, dtype=torch.float32)
        self._silu_mul(
            gate_up.data_ptr(), out.data_ptr(), num_tokens, width // 2, torch.get_num_threads()
        )
        return out

    def write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """``kv_cache[:, slot] = (key, value)`` for float32 ``[T, Hkv, D]`` tensors.

        Each token's heads must be contiguous; tokens may be strided (views of
        a fused qkv product). A bfloat16 pool stores them rounded to nearest even.
        """
        check_kv_pool(kv_cache)
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        num_tokens = key.shape[0]
        for name, t in (("key", key), ("value", value)):
            check_float_tensor(name, t, (num_tokens, num_kv_heads, head_dim))
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError(f"write_cache needs each token's heads of {name} together")
        check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size)
        row_len = num_kv_heads * head_dim
        self._write_cache(
            key.data_ptr(),
            value.data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            int(kv_cache.dtype == torch.bfloat16),
            slot_mapping.data_ptr(),
            num_tokens,
            row_len,
            key.stride(0),
            value.stride(0),
            torch.get_num_threads(),
        )

    def paged_decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Decode attention reading K/V in place from the pool.

        query: ``[B, Hq, D]`` float32; kv_cache: ``[2, num_blocks, block_size,
        Hkv, D]`` float32 or bfloat16, contiguous; block_tables: ``[B, max_blocks]`` long;
        seq_lens: ``[B]`` long, each at least 1 and at most what the table's
        width holds; the blocks each sequence uses in ``[0, num_blocks)``.
        sliding_window: each query sees its last this-many keys only (None: all);
        the blocks before them are never read. soft_cap: scores become
        ``cap * tanh(score / cap)`` (None: unchanged). Returns ``[B, Hq, D]``.
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"soft_cap must be positive, got {soft_cap}")
        check_kv_pool(kv_cache)
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        if query.dim() != 3:
            raise ValueError(
                f"query must be [num_seqs, num_heads, head_dim], not {tuple(query.shape)}"
            )
        num_seqs, num_heads = query.shape[:2]
        check_float_tensor("query", query, (num_seqs, num_heads, head_dim))
        check_decode_tables(block_tables, seq_lens, num_seqs, block_size, num_blocks)
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
        status = self._decode(
            query.data_ptr(),
            query.stride(0),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            int(kv_cache.dtype == torch.bfloat16),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.stride(0),
            scale,
            sliding_window or 0,
            soft_cap or 0.0,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged decode kernel refused its inputs (status {status})")
        return out

    def add_layer_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """LayerNorm of ``x`` (``[T, D]`` float32), or of ``residual += x`` when given (in place)."""
        num_rows, width = x.shape
        check_float_tensor("x", x, (num_rows, width))
        check_float_tensor("weight", weight, (width,))
        if bias is not None:
            check_float_tensor("bias", bias, (width,))
        if residual is not None:
            check_float_tensor("residual", residual, (num_rows, width))
            if not residual.is_contiguous():
                raise ValueError("the residual stream must be contiguous")
        x = x.contiguous()
        out = torch.empty_like(x)
        self._layer_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.contiguous().data_ptr(),
            None if bias is None else bias.contiguous().data_ptr(),
            out.data_ptr(),
            num_rows,
            width,
            eps,
            torch.get_num_threads(),
        )
        return out

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of ``x`` (``[T, heads, D]`` float32, rows of heads
        contiguous), in place; returns ``x``."""
        num_rows, num_heads, head_dim = x.shape
        check_float_tensor("x", x, (num_rows, num_heads, head_dim))
        check_float_tensor("weight", weight, (head_dim,))
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError("each row's heads must be contiguous")
        self._head_rms_norm(
            x.data_ptr(),
            weight.contiguous().data_ptr(),
            num_rows,
            num_heads,
            head_dim,
            x.stride(0),
            eps,
            torch.get_num_threads(),
        )
        return x

    def gelu_tanh(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        """GELU (tanh approximation) of ``x`` ``[T, I]``, or of its first half times its
        second (``x`` ``[T, 2 I]``) when ``gated``; float32 ``[T, I]``."""
        x = x.contiguous()
        num_rows, width = x.shape
        check_float_tensor("x", x, (num_rows, width))
        if gated and width % 2:
            raise ValueError(f"a gated activation needs an even width, not {width}")
        size = width // 2 if gated else width
        out = torch.empty(num_rows, size, dtype=torch.float32)
        self._gelu_tanh(
            x.data_ptr(), out.data_ptr(), num_rows, size, int(gated), torch.get_num_threads()
        )
        return out

    def decode_layers(
        self,
        stack: DecodeStack,
        hidden: torch.Tensor,
        rope_tables: Sequence[torch.Tensor],
        slot_mappings: Sequence[torch.Tensor],
        block_tables: Sequence[torch.Tensor],
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Every decoder layer of a decode step (one token per sequence), in one call.

        hidden: ``[T, H]`` float32 contiguous, the embeddings; it becomes the
        residual stream, updated in place. rope_tables: the step's RoPE tables,
        each ``[T, 2, D]`` float32 contiguous, as many as the stack's layers
        use. slot_mappings, block_tables: one per KV cache group, as
        :meth:`write_cache` and :meth:`paged_decode` take them, for the stack's
        pool; seq_lens: shared by the groups. Returns the last layer's output
        ``[T, H]``, which the final norm adds to the stream.
        """
        shape = stack.shape
        num_tokens = hidden.shape[0]
        check_float_tensor("hidden", hidden, (num_tokens, shape.hidden_size))
        if len(rope_tables) != stack.num_rope_tables:
            raise ValueError(
                f"the stack's layers use {stack.num_rope_tables} RoPE tables, "
                f"{len(rope_tables)} were given"
            )
        for rope in rope_tables:
            check_float_tensor("rope", rope, (num_tokens, 2, shape.head_dim))
            if not rope.is_contiguous():
                raise ValueError("the decode layers need contiguous rope tables")
        if not hidden.is_contiguous():
            raise ValueError("the decode layers need contiguous hidden states")
        if len(slot_mappings) != stack.num_kv_groups or len(block_tables) != stack.num_kv_groups:
            raise ValueError(
                f"the stack's layers use {stack.num_kv_groups} KV cache groups: give a slot "
                "mapping and a block table for each"
            )
        num_slots = stack.num_blocks * stack.block_size
        for slot_mapping, tables in zip(slot_mappings, block_tables, strict=True):
            check_slot_mapping(slot_mapping, num_tokens, num_slots)
            check_decode_tables(tables, seq_lens, num_tokens, stack.block_size, stack.num_blocks)
        out = torch.empty_like(hidden)
        pointers = ctypes.c_void_p * max(1, len(rope_tables))
        groups = ctypes.c_void_p * stack.num_kv_groups
        status = self._decode_layers(
            ctypes.addressof(stack.layers),
            len(stack.layers),
            hidden.data_ptr(),
            out.data_ptr(),
            int(shape.norm_kind),
            int(shape.act_kind),
            shape.eps,
            int(self.weight_kind(shape.weight_dtype)),
            int(stack.kv_bf16),
            pointers(*(rope.data_ptr() for rope in rope_tables)),
            groups(*(m.data_ptr() for m in slot_mappings)),
            groups(*(t.data_ptr() for t in block_tables)),
            (ctypes.c_int64 * stack.num_kv_groups)(*(t.stride(0) for t in block_tables)),
            seq_lens.data_ptr(),
            stack.block_size,
            num_tokens,
            shape.hidden_size,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.intermediate_size,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"decoder layers kernel refused its inputs (status {status})")
        return out


def supports_paged_decode(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Shapes the decode kernel handles (the C side's limits)."""
    return head_dim % 8 == 0 and num_heads % num_kv_heads == 0


@functools.cache
def native_ops() -> NativeOps | None:
    """The kernels for this CPU, built on first use; None when unavailable."""
    lib = load_library()
    return None if lib is None else NativeOps(lib)
