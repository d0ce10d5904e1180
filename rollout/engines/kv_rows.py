"""Rows of a batched KV cache: seeded from kept prefixes, merged, and read back.

A batch cache holds every row's positions right-aligned in one width; the columns before
a row's own are zeros that its attention mask hides (``mask = 0``), and so are the
columns between a kept prefix and the tokens prefilled after it:

    row r:   [0 … 0][kept prefix (p_r)][0 … 0][prefilled (s_r)]   mask 0 / 1 / 0 / 1

Position ids count a row's real tokens only (cumsum(mask) − 1), so a row computes what
it would alone. Only plain full-attention layers (transformers' ``DynamicLayer``) are
laid out this way: a sliding-window layer keeps only its window, which a kept prefix
cannot stand in for (the engine keeps nothing for such a model).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from rollout.engines.prefix_cache import LayerKV


class GrowingLayer(DynamicLayer):
    """A full-attention layer whose keys and values are views of the first columns of a
    buffer with room to grow: a decode step writes its column in place, where
    transformers' DynamicLayer copies the whole cache (torch.cat) at every token (on
    SmolLM2, 16 rows at 100 tokens, a tenth of a decode step, growing with the context).
    The first update reserves ``room`` more columns; past them the buffer doubles."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.length = 0
        self.key_buffer = self.value_buffer = torch.empty(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if start == 0 or end > self.key_buffer.shape[-2]:
            capacity = end + (self.room if start == 0 else end)
            keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[3]))
            values = value_states.new_empty((*value_states.shape[:2], capacity,
                                             value_states.shape[3]))
            if start > 0:
                keys[:, :, :start], values[:, :, :start] = self.keys, self.values
            self.key_buffer, self.value_buffer = keys, values
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length > 0:
            self.key_buffer = self.key_buffer[indices]
            self.value_buffer = self.value_buffer[indices]
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GrowingLayer: the torch engine never crops its cache")

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]
        self.values = self.value_buffer[:, :, :self.length]


def plain_layers(config: PretrainedConfig) -> bool:
    """Whether every layer of ``config``'s cache is a plain full-attention one."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def new_cache(config: PretrainedConfig, room: int) -> DynamicCache:
    """An empty batch cache: growing layers with ``room`` past their first update where
    every layer is plain full attention, else transformers' own."""
    cache = DynamicCache(config=config)
    if plain_layers(config):
        cache.layers = [GrowingLayer(room) for _ in cache.layers]
    return cache


def seeded_cache(config: PretrainedConfig, prefixes: Sequence[tuple[LayerKV | None, int]],
                 width: int, room: int) -> DynamicCache:
    """A cache of len(prefixes) rows, ``width`` columns (``room`` more reserved): row r
    holds the first n_r positions of its kept KV (layers, n_r) right-aligned (none when
    n_r = 0)."""
    cache = new_cache(config, room)
    if width == 0:
        return cache
    first = next(layers for layers, n in prefixes if n > 0 and layers is not None)
    for index, (keys_ref, values_ref) in enumerate(first):
        keys = keys_ref.new_zeros((len(prefixes), keys_ref.shape[0], width, keys_ref.shape[2]))
        values = values_ref.new_zeros((len(prefixes), values_ref.shape[0], width,
                                       values_ref.shape[2]))
        for row, (layers, n) in enumerate(prefixes):
            if n > 0 and layers is not None:
                keys[row, :, width - n:] = layers[index][0][:, :n]
                values[row, :, width - n:] = layers[index][1][:, :n]
        cache.update(keys, values, index)
    return cache


def merged(config: PretrainedConfig, caches: Sequence[DynamicCache],
           masks: Sequence[torch.Tensor], room: int) -> tuple[DynamicCache, torch.Tensor]:
    """The rows of several caches (and their [rows, width] masks) as one batch, in
    order, each left-padded with masked columns to the widest (``room`` more reserved)."""
    width = max(mask.shape[1] for mask in masks)
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in masks])
    cache = new_cache(config, room)
    for index in range(len(caches[0].layers)):
        parts = [c.layers[index] for c in caches]
        keys = torch.cat([F.pad(p.keys, (0, 0, width - p.keys.shape[2], 0)) for p in parts])
        values = torch.cat([F.pad(p.values, (0, 0, width - p.values.shape[2], 0))
                            for p in parts])
        cache.update(keys, values, index)
    return cache, mask


def read_rows(cache: DynamicCache, mask_BL: torch.Tensor, rows: Sequence[int]
              ) -> list[LayerKV]:
    """Each row's KV at its real positions (mask 1), compact and copied out of the
    batch: [kv_heads, n_r, head_dim] per layer."""
    out = []
    for row in rows:
        real_L = mask_BL[row].bool()
        out.append([(layer.keys[row][:, real_L], layer.values[row][:, real_L])
                    for layer in cache.layers])
    return out


def prefill_groups(lengths: Sequence[int], short: int = 64) -> list[list[int]]:
    """Indices of sequences to prefill together, by length, longest first: a group
    takes lengths down to half its first, so its padding costs at most as much as its
    tokens (a group whose first is ``short`` tokens or fewer takes every one left: a
    separate forward would cost more than the padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (2 * lengths[i] >= lengths[groups[-1][0]]
                       or lengths[groups[-1][0]] <= short):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
