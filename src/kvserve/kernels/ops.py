"""PyTorch-facing wrappers of the C kernels.

Each wrapper takes and returns tensors, checks what the C code relies on
(dtype, contiguity, shapes, and every index it follows: see
:mod:`kvserve.kernels.bounds`) and hands raw pointers over. Callers ask
:func:`native_ops` once; it is None when the kernels are unavailable, and
they then keep to their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels.bounds import (
    check_decode_tables,
    check_float_tensor,
    check_kv_pool,
    check_slot_mapping,
)
from kvserve.kernels.build import load_library
from kvserve.kernels.quant_ops import QuantOps
from kvserve.kernels.stack_ops import StackOps
from kvserve.kernels.weight_kind import WeightKind

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class NativeOps(StackOps, QuantOps):
    """The loaded kernels with their C signatures declared.

    bf16_dot: multiply bfloat16 weights, and read a bfloat16 KV pool, with AVX512-BF16
    dot products (None: wherever the library was built with them); False keeps the
    portable kernels that widen each bf16 element to float32, which run on any CPU
    (tests pin it to compare both).
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
        self._encoder_attention = lib.kv_encoder_attention
        self._encoder_attention.argtypes = [
            *[_p] * 4,  # qkv, out, span starts, span lengths
            *[_i64] * 3,  # sequences, heads, head_dim
            ctypes.c_float,  # scale
            ctypes.c_int,
        ]
        self._encoder_attention.restype = ctypes.c_int
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
        self._argmax_rows = lib.kv_argmax_rows
        self._argmax_rows.argtypes = [_p, _i64, _i64, _p, ctypes.c_int]
        self._argmax_rows.restype = None
        self._bind_stack_ops(lib)
        self._bind_quant_ops(lib)

    def weight_kind(self, dtype: torch.dtype) -> WeightKind:
        """How the kernels multiply linear weights of ``dtype`` on this CPU."""
        if dtype == torch.float32:
            return WeightKind.F32
        if dtype == torch.bfloat16:
            return WeightKind.BF16_DOT if self.bf16_dot else WeightKind.BF16_WIDEN
        raise ValueError(f"the linear kernels take float32 or bfloat16 weights, not {dtype}")

    def pool_kind(self, dtype: torch.dtype) -> int:
        """How the attention kernels read a KV pool of ``dtype`` (kernels.h's KV_POOL_*)."""
        if dtype == torch.float32:
            return 0
        return 2 if self.bf16_dot else 1

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

    def encoder_attention(
        self, qkv: torch.Tensor, spans: torch.Tensor, num_heads: int, head_dim: int, scale: float
    ) -> torch.Tensor:
        """Bidirectional attention within each sequence of a flat batch (an encoder's).

        ``qkv``: float32 ``[T, 3 H D]``, the q heads, then k, then v, of each row.
        ``spans``: int64 ``[2, S]``, each sequence's first row and length; the sequences
        must not overlap. Returns float32 ``[T, H D]`` (rows in no span are left unset).
        """
        qkv = qkv.contiguous()
        num_tokens = qkv.shape[0]
        width = 3 * num_heads * head_dim
        if qkv.dtype != torch.float32 or qkv.dim() != 2 or qkv.shape[1] != width:
            raise ValueError(
                f"qkv must be float32 [T, {width}], not {qkv.dtype} {tuple(qkv.shape)}"
            )
        if spans.dtype != torch.int64 or spans.dim() != 2 or spans.shape[0] != 2:
            raise ValueError(f"spans must be int64 [2, S], not {spans.dtype} {tuple(spans.shape)}")
        spans = spans.contiguous()
        starts, lens = spans[0], spans[1]
        if len(lens) and (int(starts.min()) < 0 or int((starts + lens).max()) > num_tokens):
            raise ValueError(f"a span reaches past the {num_tokens} rows of qkv")
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=torch.float32)
        status = self._encoder_attention(
            qkv.data_ptr(),
            out.data_ptr(),
            starts.data_ptr(),
            lens.data_ptr(),
            lens.shape[0],
            num_heads,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        if status == 1:
            raise ValueError(
                f"the encoder attention kernel takes head_dim in multiples of 8 "
                f"up to 256, not {head_dim}"
            )
        if status:
            raise MemoryError("the encoder attention kernel could not allocate its scores")
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
            self.pool_kind(kv_cache.dtype),
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

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a contiguous float32 ``[N, V]`` (first index on ties; NaN wins)."""
        if x.dim() != 2 or x.shape[1] < 1:
            raise ValueError(f"x must be [rows, columns] with columns >= 1, not {tuple(x.shape)}")
        check_float_tensor("x", x, tuple(x.shape))
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._argmax_rows(
            x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
        )
        return out


def supports_paged_decode(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Shapes the decode kernel handles (the C side's limits)."""
    return head_dim % 8 == 0 and num_heads % num_kv_heads == 0


@functools.cache
def native_ops() -> NativeOps | None:
    """The kernels for this CPU, built on first use; None when unavailable."""
    lib = load_library()
    return None if lib is None else NativeOps(lib)
