"""The kernels behind the one-call decode stack: the whole stack, and the per-layer
operations beyond RMSNorm and SwiGLU it chains (LayerNorm, per-head RMSNorm, GELU-tanh).

:class:`StackOps` is part of :class:`~kvserve.kernels.ops.NativeOps`; it binds these
entry points of the same library.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from kvserve.kernels.bounds import check_decode_tables, check_float_tensor, check_slot_mapping
from kvserve.kernels.decode_stack import DecodeStack

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class StackOps:
    """The decode stack's entry points (bound by :meth:`_bind_stack_ops`)."""

    pool_kind: Callable[[torch.dtype], int]

    def _bind_stack_ops(self, lib: ctypes.CDLL) -> None:
        self._decode_layers = lib.kv_decode_layers
        self._decode_layers.argtypes = [
            _p,  # layers
            _i64,
            _p,
            _p,  # residual, out
            ctypes.c_int,  # norm kind
            ctypes.c_int,  # activation kind
            ctypes.c_float,  # eps
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
            self.pool_kind(torch.bfloat16 if stack.kv_bf16 else torch.float32),
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
