# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model runner's side of a join that splices its paths' KV (formats
trained with per-path positions, `sequence_hooks.splice_join`).

Each step's `SchedulerOutput` may carry a `splice_step.SpliceStep` (set by
the scheduler, pickled with the output to every worker): the position
maps of members whose positions no longer follow
their token indices, fresh blocks to zero and single tokens' KV to copy
between blocks. The runner keeps each request's map until it finishes,
adds its deltas to the positions upstream computed from the indices
(slots stay the indices'), and copies tokens before the step's forward.

Seam: a worker subclass (`SpliceCPUWorker`, named by `worker_cls`) gives
its model runner the mixin `SpliceRunner`, which overrides the V1 model
runner's private `_update_states` and `_prepare_inputs` (tripwires in
`seams_runner`). vLLM has no hook for positions or token-level KV copies;
both could go upstream as a per-request position offset and a
`kv_cache_token_copies` beside `kv_cache_block_copies`, and this module
with them.
"""

import functools
from typing import Any

import numpy as np
import torch
from vllm_sequence_hooks.splice_step import STEP_ATTRIBUTE, PositionMap, deltas

from vllm._custom_ops import cpu_attn_reshape_and_cache
from vllm.v1.worker.cpu_worker import CPUWorker


class TokenLayout:
    """Where one token's K and V lie inside a block of one KV cache, as
    the CPU attention backend writes them (its layout depends on the
    instruction set it picked): found once by letting the backend write
    a probe block whose values name each element's token, head, channel
    and K or V.

    Args:
        cache: A layer's KV cache, ``[blocks, heads, block_size,
            2 * head_size]``.
        isa: The backend's instruction set for the layer.
    """

    def __init__(self, cache: torch.Tensor, isa: str) -> None:
        _, heads, block_size, double_head = cache.shape
        head_size = double_head // 2
        if max(block_size, heads, head_size) > 256:
            raise ValueError("a splice probes the KV layout with values "
                             "bf16 holds exactly: at most 256 tokens a "
                             "block, heads and channels")
        shape = (block_size, heads, head_size)

        def probe(values: torch.Tensor) -> torch.Tensor:
            scratch = torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype)
            key_cache, value_cache = scratch.view(1, heads, 2 * block_size,
                                                  head_size).chunk(2, dim=2)
            fill = (values + 1).expand(shape).to(cache.dtype).contiguous()
            cpu_attn_reshape_and_cache(fill, -fill, key_cache, value_cache,
                                       torch.arange(block_size), isa)
            return scratch.reshape(-1).float()

        token = probe(torch.arange(block_size).view(-1, 1, 1))
        head = probe(torch.arange(heads).view(1, -1, 1)).abs() - 1
        channel = probe(torch.arange(head_size).view(1, 1, -1)).abs() - 1
        is_value = (token < 0).long()
        token = token.abs() - 1
        if (token < 0).any():
            raise ValueError("the KV cache's layout holds elements no token "
                             "writes: a splice cannot copy its tokens")
        order = ((token * 2 + is_value) * heads + head) * head_size + channel
        # Element offsets of each token, in (K or V, head, channel) order.
        self.offsets = torch.argsort(order).view(block_size, -1)
        self.block_size = block_size

    def copy(self, cache: torch.Tensor, copies: np.ndarray) -> None:
        """Copies tokens' K and V in one cache.

        Args:
            cache: The cache, ``[kernel blocks, ...]``, contiguous.
            copies: ``[n, 4]``: source block, offset, destination block,
                offset, in this cache's kernel blocks.
        """
        flat = cache.view(-1)
        row = flat.numel() // cache.shape[0]
        src = copies[:, 0:1] * row + self.offsets[copies[:, 1]]
        dst = copies[:, 2:3] * row + self.offsets[copies[:, 3]]
        flat[dst.reshape(-1)] = flat[src.reshape(-1)]


class SpliceRunner:
    """Mixin of the V1 model runner: positions by map, token copies."""

    def _update_states(self, scheduler_output: Any) -> Any:
        """Upstream's update, then the step's maps, zeroing and copies
        (after upstream's own zeroing and block copies)."""
        result = super()._update_states(scheduler_output)  # type: ignore
        maps = self._splice_maps()
        for request_id in scheduler_output.finished_req_ids:
            maps.pop(request_id, None)
        step = getattr(scheduler_output, STEP_ATTRIBUTE, None)
        if step:
            maps.update(step.position_maps)
            if step.zero_blocks:
                self._zero_block_ids(step.zero_blocks)  # type: ignore
            if step.token_copies:
                self._copy_tokens(np.asarray(step.token_copies, np.int64))
        return result

    def _prepare_inputs(self, scheduler_output: Any,
                        num_scheduled_tokens: np.ndarray) -> Any:
        """Upstream's inputs, positions and slots by index; then each
        mapped request's positions moved by its deltas."""
        result = super()._prepare_inputs(  # type: ignore
            scheduler_output, num_scheduled_tokens)
        maps = self._splice_maps()
        if maps:
            batch = self.input_batch  # type: ignore
            starts = self.query_start_loc.np  # type: ignore
            for i, request_id in enumerate(batch.req_ids):
                position_map = maps.get(request_id)
                if position_map is None:
                    continue
                lo, hi = int(starts[i]), int(starts[i + 1])
                first = int(batch.num_computed_tokens_cpu[i])
                moved = deltas(position_map, np.arange(first, first + hi - lo))
                self.positions[lo:hi] += torch.from_numpy(  # type: ignore
                    moved).to(self.positions.dtype)  # type: ignore
        return result

    def _splice_maps(self) -> dict[str, PositionMap]:
        """The position maps of the requests that have one."""
        maps = self.__dict__.get("_sequence_hooks_maps")
        if maps is None:
            maps = self.__dict__["_sequence_hooks_maps"] = {}
        return maps

    def _copy_tokens(self, copies: np.ndarray) -> None:
        """Copies tokens' KV in every layer's cache (once per cache that
        layers share)."""
        layouts = self.__dict__.setdefault("_sequence_hooks_layouts", {})
        num_blocks = self.kv_cache_config.num_blocks  # type: ignore
        context = self.compilation_config.static_forward_context  # type: ignore
        seen: set[int] = set()
        for layer in context.values():
            cache = getattr(layer, "kv_cache", None)
            if not isinstance(cache, torch.Tensor) or cache.data_ptr() in seen:
                continue
            seen.add(cache.data_ptr())
            key = (tuple(cache.shape[1:]), cache.dtype, layer.isa)
            if key not in layouts:
                layouts[key] = TokenLayout(cache, layer.isa)
            layout = layouts[key]
            ratio = cache.shape[0] // num_blocks
            kernel = copies.copy()
            for block, offset in ((0, 1), (2, 3)):
                kernel[:, block] = (copies[:, block] * ratio +
                                    copies[:, offset] // layout.block_size)
                kernel[:, offset] = copies[:, offset] % layout.block_size
            layout.copy(cache, torch.from_numpy(kernel))


@functools.cache
def _splicing(runner_cls: type) -> type:
    """``runner_cls`` with `SpliceRunner` first."""
    return type(f"Splice{runner_cls.__name__}", (SpliceRunner, runner_cls), {})


class SpliceCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model runner splices (`SpliceRunner`).

    Refuses Model Runner V2 (its positions come from elsewhere).
    """

    def init_device(self) -> None:
        """Upstream's device and model runner; the runner then splices."""
        super().init_device()
        if self.use_v2_model_runner:
            raise ValueError("special_kwargs: a format that splices KV "
                             "runs on the V1 model runner: set "
                             "VLLM_USE_V2_MODEL_RUNNER=0")
        runner = self.model_runner
        runner.__class__ = _splicing(type(runner))
