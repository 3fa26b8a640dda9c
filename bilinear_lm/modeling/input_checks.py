"""Input checks of the model's forward, and the one vocabulary check the rest of the package shares
(``check_token_ids``: perplexity, the training data): each raises a ValueError naming the problem and the fix, where
torch would say only ``IndexError: index out of range in self``.

Imported by the modeling code, so it travels with it as remote code (torch only).
"""

import torch


def check_token_ids(ids: torch.Tensor, vocab_size: int, fix: str, where: str | None = None,
                    what: str = "token id", ignore: int | None = None) -> None:
    """The one vocabulary check (model, perplexity, training data): raise a ValueError naming the first id of ``ids``
    outside ``[0, vocab_size)`` (but ``ignore``), where it is (``where``, else its position in ``ids`` flattened) and
    ``fix`` (torch's ``IndexError: index out of range in self`` names neither)."""
    flat = ids.reshape(-1)
    outside = (flat < 0) | (flat >= vocab_size)
    bad = (outside & (flat != ignore) if ignore is not None else outside).nonzero()
    if bad.numel():
        position = int(bad[0, 0])
        raise ValueError(f"{what} {int(flat[position])} {where or f'at position {position}'} is outside the model's "
                         f"vocabulary of {vocab_size} ids (0..{vocab_size - 1}): {fix}")


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a ValueError naming the problem and the fix for empty ``input_ids`` (no rows or no tokens) or ids outside
    ``[0, vocab_size)``."""
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(f"input_ids must be [batch, seq_len] with batch >= 1 and seq_len >= 1, got shape "
                         f"{tuple(input_ids.shape)}; pass at least one row of at least one token")
    check_token_ids(input_ids, vocab_size, "the tokenizer does not match the model: use the tokenizer saved with the "
                                           "checkpoint, or build the model with a vocab_size of len(tokenizer)")


def check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Raise a ValueError naming the first label outside ``[0, vocab_size)`` that is not -100 (the loss's
    ``ignore_index``): torch's cross-entropy says only ``IndexError: Target 12 is out of bounds``."""
    check_token_ids(labels, vocab_size, what="label", ignore=-100,
                    fix="labels are token ids of the model's vocabulary (the input ids: the model shifts them), or -100 "
                        "where no loss is wanted; use the tokenizer saved with the checkpoint")


def check_attention_mask(attention_mask: torch.Tensor, shape: tuple[int, int], cached: int,
                         has_attention: bool = False) -> None:
    """Raise a ValueError naming the shapes unless ``attention_mask`` is [batch, seq_len] for inputs of ``shape``, or
    [batch, cached + seq_len] (the whole sequence's, which generate() passes after ``cached`` tokens); only the latter
    after cached tokens for a model with attention layers (their cached keys' padding is in it)."""
    B, T = shape
    lengths = (cached + T,) if has_attention and cached else (T, cached + T) if cached else (T,)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] not in lengths:
        after = f" after {cached} cached tokens" if cached else ""
        why = " (the whole sequence's: the attention layers mask the cached keys' padding)" if has_attention else ""
        raise ValueError(f"BilinearModel.forward: attention_mask of shape {tuple(attention_mask.shape)} does not fit "
                         f"the inputs' [batch, seq_len] = [{B}, {T}]{after}: pass a mask of shape "
                         + " or ".join(f"[{B}, {n}]" for n in lengths) + why)
