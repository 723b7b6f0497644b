"""PerformerConfig (model_type "performer")."""

import math
import warnings
from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers.utils.type_validators import interval

from ..ops.feature_maps import FEATURE_MAPS
from .common import SHARED_FIELDS_DOC, LinearAttentionConfig, at_least_or_none, positive, renamed_fields


@renamed_fields("0.3.0", num_random_features="num_features", kernel="feature_map", kernel_eps="feature_eps")
@strict(accept_kwargs=True)
class PerformerConfig(LinearAttentionConfig):
    """Configuration of a Performer (Choromanski et al., 2021), FAVOR+ attention.

    Attention has no length limit of its own: with sinusoidal or rotary positions the model runs past
    max_position_embeddings.

    Example:
        >>> config = PerformerConfig(
        ...     hidden_size=256, num_attention_heads=4, position_embedding_type="rotary", num_features=128,
        ... )

    Args:
        num_features: m, the number of features per head (default 256; e.g. 128): random features drawn for
            "softmax" and "relu", the learned map's outputs for "hedgehog", which must be even (two softmax halves of
            m / 2).
        feature_map: the map phi of queries and keys whose products stand for the attention scores: "softmax"
            (positive random features, Lemma 1), "relu" (ReLU of random features, the generalized kernel of Section
            2.2) or "hedgehog" (a learned per-head map, Zhang et al. 2024: phi(x) = [softmax(xW + b),
            softmax(-(xW + b))], trained with the model; see HedgehogFeatureMap) (default "softmax").
        orthogonal_features: draw exactly orthogonal blocks (True) or i.i.d. Gaussian rows (default True). Unused
            with feature_map="hedgehog".
        feature_redraw_interval: redraw the features every this many training forward passes (None or 0:
            never). Each draw is a pure function of (feature_seed, layer, draw index): every DDP rank draws the
            same features without communication (default 1000; e.g. None). Ignored with feature_map="hedgehog": a
            learned map is never redrawn.
        feature_seed: seed of the feature draws (default 0; e.g. 42). Unused with feature_map="hedgehog".
        feature_eps: the epsilon the "relu" map adds to every feature, so that no query meets only zero scores
            (default 1e-3).
        causal_chunk_size: chunk of the causal prefix sums, in tokens: a speed / memory trade-off that, up to rounding,
            does not change the result (default 32; e.g. 64).
        hybrid_window: w, or None for plain linear heads (default None; e.g. 64). When set, each global head takes
            exact softmax scores on its window (causal: the last w keys, itself included; bidirectional: the keys
            with |s - t| < w) and the feature map's linear scores on all other keys, the two normalized together
            with a learned per-head balance gamma = exp(window_balance), which starts at 1 (LoLCATs, Zhang et al.
            2024; see ``attention.hybrid``). Works with every feature map, "softmax", "relu" and "hedgehog"; with the
            random "softmax" features the linear scores keep the softmax's scale, so that at gamma = 1 a head
            estimates softmax attention (exact on the window, FAVOR+ elsewhere). Decoding keeps the last w - 1
            keys, values and key features besides the (S, z) sums: memory still constant in the context length.
        hybrid_sinks: S, the number of attention sinks of the hybrid (default 0; e.g. 1 for BERT's [CLS]): the
            first S real tokens of each sequence take exact softmax scores from every query that sees them, as if
            in its window, and never the linear part (StreamingLLM, Xiao et al. 2024). all-MiniLM-L6-v2 puts
            21-26% of its attention on [CLS] in four of its six layers, a spike a linear map follows badly.
            Decoding keeps the sinks' keys and values: memory still constant. Needs hybrid_window.
        hybrid_query_scale: give the hybrid's linear scores a learned log scale per query (default False):
            l_t = q_t·a_h + b_h, so that exp(l_t) phi(q_t)·phi(k_s) stands for the exact exp(scale q_t·k_s) of a
            far key, on the window's own scale (``attention.hybrid``'s query_log_scale, added to the random
            "softmax" map's own). Without it a learned map's scores meet the window's scores after these lost
            exp(c_t), c_t the largest window logit: a quantity of the window's keys that the map, a function of
            q_t and k_s alone, cannot follow. Parameters query_scale_weight (global heads, head_dim) and
            query_scale_bias (global heads,), zero at init; attention transfer fits them by least squares on the
            original's attention before stage 1 (``calibrate_query_scale``). Needs hybrid_window.
        hybrid_key_scale: give each key's linear features a learned log scale (default False): phi(k_s) times
            exp(r_s), r_s = 20 tanh((k_s·a'_h + b'_h) / 20), so that a key can weigh more or less with every query,
            as exp(q·k) lets it. The learned map cannot do this by itself: each half of its features is a softmax,
            so every key's features sum to the same. Parameters key_scale_weight (global heads, head_dim) and
            key_scale_bias (global heads,), zero at init (r = 0); attention transfer trains them with the maps.
            Needs hybrid_window.
        hybrid_select_blocks: K, the far key blocks each block of queries scores exactly (default 0, none; e.g.
            4): positions fall in blocks of hybrid_select_block_size, and each query block chooses the K blocks of
            keys beyond its window whose mean key its mean query scores highest; its queries give their keys the
            window's exact softmax scores instead of the linear ones (``attention.far_blocks``, after NSA's
            selection branch). A feature map spreads a head's far weight over every key; a trained softmax head
            puts much of it on a few keys it picks by content. Cost per query: n / B block scores and K B exact
            ones. Encoders only (a decoder's state would have to keep every key), with the linear scores on the
            softmax's scale: feature_map="softmax" or hybrid_query_scale=True. Needs hybrid_window.
        hybrid_select_block_size: B, the size of those blocks in tokens (default 32).
        hybrid_exact_length: L, or None (default None; e.g. 512, the original's positions in a long conversion):
            a sequence of at most L real tokens takes exact softmax attention over all its keys on the hybrid
            heads, as if the window covered it, and only longer ones the hybrid. Decided per sequence by its
            attention mask, so padding and batching leave every answer as it is. Up to a converted BERT's own
            positions exact attention costs what the original's does, and it is the attention the conversion
            imitates; the linear part is for lengths the original cannot read. Attention transfer and the long
            inputs of the steps after it (``linearformers.conversion``) run the hybrid at every length; the steps'
            short-text terms read as saved. Encoders only. Needs hybrid_window.
    """

    __doc__ = (__doc__ or "") + SHARED_FIELDS_DOC  # no docstring under python -OO
    model_type = "performer"

    num_features: int = positive(default=256)
    feature_map: Literal[FEATURE_MAPS] = "softmax"
    orthogonal_features: bool = True
    feature_redraw_interval: int | None = at_least_or_none(0)(default=1000)
    feature_seed: int = 0
    feature_eps: int | float = interval(min=0.0, max=math.inf, exclude_max=True)(default=1e-3)
    causal_chunk_size: int = positive(default=32)
    hybrid_window: int | None = at_least_or_none(1)(default=None)
    hybrid_sinks: int = interval(min=0)(default=0)
    hybrid_query_scale: bool = False
    hybrid_key_scale: bool = False
    hybrid_select_blocks: int = interval(min=0)(default=0)
    hybrid_select_block_size: int = positive(default=32)
    hybrid_exact_length: int | None = at_least_or_none(1)(default=None)

    @property
    def draws_random_features(self) -> bool:
        """Whether the feature map uses FAVOR+ random features (drawn, and redrawn on a schedule); False for the
        learned "hedgehog" map."""
        return self.feature_map != "hedgehog"

    @property
    def random_feature_kernel(self) -> bool:
        """Deprecated name of :attr:`draws_random_features`; goes away in linearformers 0.3.0."""
        warnings.warn(
            "PerformerConfig.random_feature_kernel is renamed draws_random_features; the name random_feature_kernel "
            "goes away in linearformers 0.3.0",
            FutureWarning,
            stacklevel=2,
        )
        return self.draws_random_features

    def describe(self) -> tuple[str, str, list[str]]:
        """What the model card says of this attention: the rest of its summary (after the family's description in
        ``modeling/registry.py``), the details (markdown bullets) and the limits."""
        if self.feature_map == "hedgehog":
            summary = (
                f" with a learned Hedgehog feature map (m={self.num_features} features per head, "
                "[softmax(xW + b), softmax(-(xW + b))])."
            )
            features = (
                f"- learned feature map per head: m = {self.num_features} (hedgehog map), trained and saved "
                "with the weights; never redrawn"
            )
            limits = [
                "The Hedgehog map is learned with the model: it imitates softmax attention only as well as training "
                "made it."
            ]
        else:
            summary = (
                f" with m={self.num_features} {'orthogonal' if self.orthogonal_features else 'i.i.d.'} random "
                f"features and the {self.feature_map} feature map."
            )
            redraw = (
                f"every {self.feature_redraw_interval} training forward passes (micro-batches: with gradient "
                "accumulation, more often than every that many optimizer steps)"
                if self.feature_redraw_interval
                else "never"
            )
            features = (
                f"- random features per head: m = {self.num_features} ({self.feature_map} map), saved with "
                f"the weights; redrawn {redraw}, deterministically from feature_seed={self.feature_seed}"
            )
            if self.feature_map == "softmax":
                limits = ["FAVOR+ approximates softmax attention; the error falls as 1/sqrt(m)."]
            else:
                limits = [
                    "The ReLU feature map gives an attention of its own, not an approximation of softmax attention: "
                    "weights trained with softmax attention do not carry over unchanged."
                ]
        query_scale = (
            " The linear scores take a learned log scale per query (hybrid_query_scale), which puts them on the "
            "window's scale."
            if self.hybrid_query_scale
            else ""
        )
        key_scale = (
            " Each key's linear features take a learned log scale (hybrid_key_scale), its own weight with every query."
            if self.hybrid_key_scale
            else ""
        )
        select = (
            f" Each block of {self.hybrid_select_block_size} queries also scores the {self.hybrid_select_blocks} "
            "blocks of far keys its mean query prefers exactly, as in the window (hybrid_select_blocks)."
            if self.hybrid_window and self.hybrid_select_blocks
            else ""
        )
        exact = (
            f" A sequence of at most {self.hybrid_exact_length} real tokens takes exact softmax attention over all "
            "its keys instead (hybrid_exact_length)."
            if self.hybrid_window and self.hybrid_exact_length
            else ""
        )
        details = (
            f"{features}\n- causal chunk size: {self.causal_chunk_size}\n- position embeddings: "
            f"{self.position_embedding_type}\n- cost: O(n m d) time and memory linear in the sequence length."
            f"{self.local_heads_text()}{self.hybrid_text('linear attention on the other keys')}{query_scale}{key_scale}"
            f"{select}{exact}"
        )
        if self.position_embedding_type == "absolute":
            limits.append(f"Learned absolute positions: at most {self.max_position_embeddings} tokens.")
        else:
            limits.append("No length limit of its own: positions are computed, not learned.")
        return summary, details, limits

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.feature_map == "hedgehog" and self.num_features % 2:
            raise ValueError(
                f"feature_map='hedgehog' needs an even num_features (two softmax halves of m / 2), got "
                f"{self.num_features}"
            )
        if self.hybrid_sinks and not self.hybrid_window:
            raise ValueError(
                f"hybrid_sinks={self.hybrid_sinks} needs a hybrid_window: sinks join the exact softmax window of the "
                "hybrid heads; set hybrid_window (e.g. 64), or hybrid_sinks=0"
            )
        if self.hybrid_query_scale and not self.hybrid_window:
            raise ValueError(
                "hybrid_query_scale=True needs a hybrid_window: it scales the linear scores of the hybrid heads "
                "against their softmax window; set hybrid_window (e.g. 64), or hybrid_query_scale=False"
            )
        if self.hybrid_key_scale and not self.hybrid_window:
            raise ValueError(
                "hybrid_key_scale=True needs a hybrid_window: it scales the keys' features in the linear part of the "
                "hybrid heads; set hybrid_window (e.g. 64), or hybrid_key_scale=False"
            )
        if self.hybrid_exact_length is not None:
            if not self.hybrid_window:
                raise ValueError(
                    f"hybrid_exact_length={self.hybrid_exact_length} needs a hybrid_window: it widens the exact window "
                    "of the hybrid heads over short inputs; set hybrid_window (e.g. 64), or hybrid_exact_length=None"
                )
            if self.is_decoder:
                raise ValueError(
                    "hybrid_exact_length is for encoders: a decoder's cache keeps the hybrid's state, which exact "
                    "attention over a short prompt would not build; set hybrid_exact_length=None"
                )
        if self.hybrid_select_blocks:
            if not self.hybrid_window:
                raise ValueError(
                    f"hybrid_select_blocks={self.hybrid_select_blocks} needs a hybrid_window: the chosen far keys "
                    "join the exact window of the hybrid heads; set hybrid_window (e.g. 64), or hybrid_select_blocks=0"
                )
            if self.is_decoder:
                raise ValueError(
                    "hybrid_select_blocks is for encoders: a decoder's state would have to keep every key to choose "
                    "among; set hybrid_select_blocks=0"
                )
            if self.feature_map != "softmax" and not self.hybrid_query_scale:
                raise ValueError(
                    f"hybrid_select_blocks needs the linear scores on the softmax's scale, so that a chosen key's "
                    f"exact score replaces its linear one: feature_map='softmax' or hybrid_query_scale=True, got "
                    f"feature_map={self.feature_map!r} without hybrid_query_scale"
                )


__all__ = ["PerformerConfig"]
