"""The stack both families share, from the embeddings to the heads, in one file as a transformers modeling file
holds its model. The global heads are the family's: ``performer.py`` and ``linformer.py`` each subclass
``LinearAttention`` to write ``global_attention``, and bind the model classes here to their config class and that
attention class (``attention_class``, which the model hands to every ``LinearAttentionBlock``).

Read top to bottom: the tensors a conversion adds, position encodings, embeddings, the attention base with its
local heads, MLP, block, pooler and MLM head; then the pretrained base (init, the accepted attn_implementation
values, saves with the Hub code), input checks, the base model and the heads. Shapes: hidden states are (batch,
length, hidden_size); inside attention tensors are (batch, heads, length, head_dim).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    SequenceClassifierOutput,
)
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ..configuration.common import LinearAttentionConfig
from ..ops.local import causal_local_attention, local_attention, num_relative_positions
from .cache import LinearAttentionCache

logger = logging.get_logger(__name__)

NO_ATTENTION_MAPS = (
    "output_attentions=True is not supported: linear attention never forms the n x n attention matrix, which is "
    "what makes it linear. Inspect a layer with exact softmax attention instead "
    "(linearformers.ops.softmax_attention)."
)


# softmax attention implementations that scripts pass out of habit; accepted and recorded, the linear kernels run
SOFTMAX_ATTN_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
)


@dataclass(frozen=True)
class NewTensor:
    """A tensor that a module adds to the softmax attention of BERT / GPT-2, declared by the module in its
    ``new_tensors`` (attribute name -> NewTensor; a submodule's every tensor is new). ``convert.py`` starts it,
    ``transfer.py`` trains it (a parameter; a buffer stays as it is).

    start: how a conversion starts it: "model" (the model's own initialization), "zeros", or "window_means" (each of
        the k slots the mean of its window of n / k positions, so that at k = n it is the identity).
    projection: one of Linformer's E / F along the sequence, which attention transfer trains at its own
        ``projection_learning_rate`` (and, in a decoder, on their nonzero entries only).
    """

    start: Literal["model", "zeros", "window_means"] = "model"
    projection: bool = False


def new_tensors(model: nn.Module) -> dict[str, NewTensor]:
    """Every tensor of ``model`` that one of its modules declares new (``new_tensors``), by its name in
    ``model.named_parameters()`` / ``named_buffers()``; a tensor the module does not have (None) is left out."""
    found = {}
    for prefix, module in model.named_modules():
        for attribute, declared in getattr(module, "new_tensors", {}).items():
            value = getattr(module, attribute, None)
            name = f"{prefix}.{attribute}" if prefix else attribute
            if isinstance(value, nn.Module):
                for inner, _ in (*value.named_parameters(), *value.named_buffers()):
                    found[f"{name}.{inner}"] = declared
            elif value is not None:
                found[name] = declared
    return found


def sinusoidal_embeddings(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017 sinusoidal positions for (batch, length) ids -> (batch, length, dim), float32."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=position_ids.device, dtype=torch.float32) / half)
    angles = position_ids.float()[..., None] * freq
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return nn.functional.pad(emb, (0, dim - 2 * half))


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (Su et al. 2021) tables for (batch, length) ids -> cos, sin of shape (batch, 1, length, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    angles = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class LinearAttentionEmbeddings(nn.Module):
    """Word + position (+ token type) embeddings. The encoder normalizes them (BERT); the decoder does not (GPT-2)."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "absolute"
            else None
        )
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size)
            if config.type_vocab_size > 0 and not config.is_decoder
            else None
        )
        self.LayerNorm = None if config.is_decoder else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.position_embeddings is not None:
            limit = self.config.max_position_embeddings
            # checked in eager mode only: reading the maximum would break a compiled graph
            if not torch.compiler.is_compiling() and position_ids.numel() and int(position_ids.max()) >= limit:
                raise ValueError(
                    f"position {int(position_ids.max())} is past max_position_embeddings={limit} of this model's "
                    "learned absolute positions. Truncate the input, or use position_embedding_type='rotary' or "
                    "'sinusoidal', which have no length limit."
                )
            embeddings = embeddings + self.position_embeddings(position_ids)
        elif self.config.position_embedding_type == "sinusoidal":
            embeddings = embeddings + sinusoidal_embeddings(position_ids, self.config.hidden_size).to(embeddings.dtype)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(position_ids)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.LayerNorm is not None:
            embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class LinearAttention(nn.Module):
    """Self-attention: q/k/v projections, the family's global kernel on the first heads, optional local
    windowed softmax heads on the last ``num_local_heads``, and the output projection ``o_proj``.

    A family subclasses it and writes ``global_attention``; ``attention_name`` names that attention in messages.
    PEFT LoRA targets: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (and ``up_proj``, ``down_proj`` in the MLP).
    """

    attention_name = "linear attention"
    # the tensors this module adds to a converted model (NewTensor); a family's attention extends the table
    new_tensors: ClassVar[dict[str, NewTensor]] = {"relative_bias": NewTensor(start="zeros")}

    def __init__(self, config: LinearAttentionConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_local = config.num_local_heads
        self.num_global = config.num_attention_heads - config.num_local_heads
        self.head_dim = config.head_dim
        self.causal = config.is_decoder
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.relative_bias = (
            nn.Parameter(torch.zeros(self.num_local, num_relative_positions(config.local_window, self.causal)))
            if self.num_local and config.local_relative_bias
            else None
        )

    def extra_repr(self) -> str:
        local = f", num_local_heads={self.num_local}, local_window={self.config.local_window}" if self.num_local else ""
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}{local}"

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: LinearAttentionCache | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states (batch, n, hidden_size) -> (batch, n, hidden_size).

        attention_mask: (batch, n) bool, True for the real tokens among these n; None: no padding.
        position_embeddings: the rotary (cos, sin) tables, each (batch, 1, n, head_dim), or None.
        past_key_values: the decoder's cache, continued here; None: no cache.
        position_ids: (batch, n) positions of these tokens (decoding steps read them)."""
        q, k, v = (self._split(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if position_embeddings is not None:
            q, k = apply_rotary(q, *position_embeddings), apply_rotary(k, *position_embeddings)
        g = self.num_global
        # plain assignments around the kernel calls: where a kernel breaks a compiled graph, an object built in this
        # call (a list being appended to) would sit on the stack, and dynamo would recompile the rest at every call
        out = None
        if g:
            out = self.global_attention(q[:, :g], k[:, :g], v[:, :g], attention_mask, past_key_values, position_ids)
        if self.num_local:
            local = self.local_heads(q[:, g:], k[:, g:], v[:, g:], attention_mask, past_key_values)
            out = local if out is None else torch.cat([out, local], dim=1)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def local_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
    ) -> torch.Tensor:
        """The local heads: windowed softmax; with a cache, over the kept window followed by the new tokens."""
        window = self.config.local_window
        if past_key_values is None:
            return local_attention(
                q, k, v, window, causal=self.causal, key_padding_mask=attention_mask, relative_bias=self.relative_bias
            )
        past = past_key_values.update_local_window(self.layer_idx, k, v, attention_mask, window)
        return causal_local_attention(
            q, k, v, window, past=past, key_padding_mask=attention_mask, relative_bias=self.relative_bias
        )

    def global_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """The family's kernel on the global heads: q, k, v (batch, global heads, n, head_dim) -> the same shape."""
        raise NotImplementedError(f"{type(self).__name__} must implement global_attention")


class LinearAttentionMLP(nn.Module):
    """The feed-forward block: up_proj, activation, down_proj."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden_states)))


class LinearAttentionBlock(GradientCheckpointingLayer):
    """One block, around the family's ``attention_class``. Encoder (BERT, post-LN): x = LN(x + attn(x));
    x = LN(x + mlp(x)). Decoder (GPT-2, pre-LN): x = x + attn(LN(x)); x = x + mlp(LN(x)).

    ``config.chunk_size_feed_forward`` C > 0 (transformers' field) runs the position-wise mlp on C positions at a
    time, the last piece shorter where C does not divide the length: the same outputs, with its (C, intermediate)
    temporaries in place of (n, intermediate) ones."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int, attention_class: type[LinearAttention]):
        super().__init__()
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.pre_norm = config.is_decoder
        self.attention = attention_class(config, layer_idx)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = LinearAttentionMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: LinearAttentionCache | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attend(x):
            return self.attention(x, attention_mask, position_embeddings, past_key_values, position_ids)

        if self.pre_norm:
            hidden_states = hidden_states + self.dropout(attend(self.attention_norm(hidden_states)))
            return hidden_states + self.dropout(self.feed_forward(self.mlp_norm(hidden_states)))
        attn = attend(hidden_states)
        hidden_states = self.attention_norm(hidden_states + self.dropout(attn))
        return self.mlp_norm(hidden_states + self.dropout(self.feed_forward(hidden_states)))

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The mlp over (batch, n, hidden), ``chunk_size_feed_forward`` positions at a time when that is set and
        shorter than n."""
        chunk = self.chunk_size_feed_forward
        if not chunk or chunk >= hidden_states.shape[1]:
            return self.mlp(hidden_states)
        return torch.cat([self.mlp(part) for part in hidden_states.split(chunk, dim=1)], dim=1)


class LinearAttentionPooler(nn.Module):
    """BERT's pooler: tanh(W h_[CLS]), [CLS] being each row's first real token: with left padding position 0 is
    a pad, and padding must not change an answer."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            first = hidden_states[:, 0]
        else:  # argmax gives the first True; a row of padding only pools position 0
            rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            first = hidden_states[rows, attention_mask.to(hidden_states.device).int().argmax(-1)]
        return self.activation(self.dense(first))


class MaskedLMHead(nn.Module):
    """BERT's MLM head: dense + activation + LayerNorm, then the decoder tied to the word embeddings."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.LayerNorm(self.act(self.dense(hidden_states))))


def _attention_in_words(model: LinearAttentionPreTrainedModel) -> str:
    """The attention a model builds, in words, for messages."""
    words = model.attention_class.attention_name
    if model.config.num_local_heads:
        words += f" with {model.config.num_local_heads} local windowed-softmax head(s)"
    return words


class LinearAttentionPreTrainedModel(PreTrainedModel):
    """The base of every linearformers model: the shared weight init, the accepted ``attn_implementation`` values,
    and saves that carry the Hub code (``save_pretrained``).

    A family's PreTrainedModel sets ``config_class`` and ``attention_class`` (its LinearAttention subclass, which
    every LinearAttentionBlock builds), and initializes its own modules in ``_init_weights`` before deferring here.
    """

    attention_class: type[LinearAttention] = LinearAttention
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LinearAttentionEmbeddings", "LinearAttentionBlock"]
    _can_record_outputs = {"hidden_states": LinearAttentionBlock}
    # heads without a pooler (masked LM, token classification, QA) load checkpoints that have one, as BERT's do
    _keys_to_ignore_on_load_unexpected = [r"pooler\."]

    def __init__(self, config: LinearAttentionConfig, *inputs, **kwargs):
        # by model_type, not isinstance: exported remote code loads config and model classes as separate copies
        expected = getattr(self.config_class, "model_type", None)
        if expected and config.model_type != expected:
            raise ValueError(
                f"got a config of model_type '{config.model_type}' ({type(config).__name__}), but "
                f"{type(self).__name__} builds model_type '{expected}' models; build it from a "
                f"{self.config_class.__name__}, or use the classes of the config's own family"
            )
        super().__init__(config, *inputs, **kwargs)

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        """Accept the usual ``attn_implementation`` values and record them; the linear kernels run either way.

        Scripts pass ``attn_implementation="sdpa"`` (or ``"eager"``, ``"flash_attention_2"``, ...) out of habit.
        Those name softmax kernels over an n x n score matrix, which linear attention never forms: FAVOR+ or
        Linformer (and the local heads' windowed softmax) always run. The value is kept in
        ``config._attn_implementation`` (default ``"eager"``) and changes nothing; anything else raises.
        """
        if attn_implementation is None:
            return "eager"
        name = attn_implementation.removeprefix("paged|") if isinstance(attn_implementation, str) else None
        if name not in SOFTMAX_ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation={attn_implementation!r} is not a value {type(self).__name__} accepts: its "
                f"attention is {_attention_in_words(self)}, chosen by the config, not a softmax kernel that "
                f"transformers can swap. Leave attn_implementation out (or pass one of "
                f"{', '.join(SOFTMAX_ATTN_IMPLEMENTATIONS)}, which are recorded and change nothing)."
            )
        if name != "eager":
            logger.warning_once(
                f"attn_implementation={attn_implementation!r} is recorded but not used: this model runs "
                f"{_attention_in_words(self)}. Linear attention never forms the n x n softmax attention that "
                "sdpa / flash / flex attention compute; outputs, speed and memory are those of the linear kernels."
            )
        return attn_implementation

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LinearAttention) and module.relative_bias is not None:
            init.zeros_(module.relative_bias)
        if isinstance(module, MaskedLMHead):
            init.zeros_(module.decoder.bias)

    # Hub code: the flat model code and an auto_map for AutoConfig and all seven Auto model classes
    # (modeling/hub_code.py), so that the folder loads with trust_remote_code=True where linearformers is not
    # installed. It goes where the model is published: push_to_hub (model.push_to_hub, save_pretrained(push_to_hub=
    # True)), hub_cards' export, and, as transformers does, every save once register_for_auto_class was called
    # (Trainer's saves and pushes included). transformers' own copy (custom_object_save) cannot follow this package's
    # nested imports, so it never runs.
    _hub_code_registered = False

    def _writes_hub_code(self) -> bool:
        return self._hub_code_registered or getattr(type(self.config), "_hub_code_registered", False)

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs) -> None:
        """transformers' ``save_pretrained``; after ``register_for_auto_class`` (of the model or config class), the
        folder also gets the flat model code and an ``auto_map`` in ``config.json`` (uploaded too with
        ``push_to_hub=True``, which writes them in any case)."""
        from .hub_code import write_hub_files, write_remote_code

        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if self._writes_hub_code() and self.should_save_on_this_rank(is_main_process) and os.path.isdir(save_directory):
            write_hub_files(self.config, save_directory)
            # Trainer's checkpoint pushes (hub_strategy "every_save") copy only config and weights from
            # output_dir/checkpoint-N into output_dir and upload output_dir: the code goes there too, so every pushed
            # revision loads
            parent = os.path.dirname(os.path.abspath(save_directory))
            # Trainer names them PREFIX_CHECKPOINT_DIR-N; transformers.trainer_utils is not imported for it (it pulls in peft)
            if re.fullmatch(r"checkpoint-\d+", os.path.basename(os.path.abspath(save_directory))):
                write_remote_code(parent)

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        # push_to_hub and save_pretrained(push_to_hub=True) upload from here, after saving: the code and auto_map
        # are written now, so that they go up with the weights
        from .hub_code import write_hub_files

        write_hub_files(self.config, working_dir)
        return super()._upload_modified_files(working_dir, *args, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class: str | type = "AutoModel") -> None:
        """Make every ``save_pretrained`` of this class write the flat Hub code and an ``auto_map`` for every Auto
        class, as transformers does for registered classes (transformers registers remote-code classes it loads,
        so those save their code again). ``auto_class`` must name one of transformers' Auto classes."""
        import transformers.models.auto as auto_module

        name = auto_class if isinstance(auto_class, str) else auto_class.__name__
        if not hasattr(auto_module, name):
            raise ValueError(f"{name} is not a valid auto class; pass one of transformers' (e.g. 'AutoModel')")
        cls._hub_code_registered = True


def _checked_inputs(input_ids, inputs_embeds, embeddings: nn.Module) -> tuple[str, tuple[int, ...]]:
    """Check input_ids / inputs_embeds; return the name and shape of the one given, for later messages."""
    if (input_ids is None) == (inputs_embeds is None):
        got = "both" if input_ids is not None else "neither"
        raise ValueError(f"pass exactly one of input_ids or inputs_embeds; got {got}")
    if input_ids is not None:
        name, tensor = "input_ids", input_ids
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            hint = "; add the batch dimension to one sequence with input_ids[None]" if input_ids.dim() == 1 else ""
            raise ValueError(f"input_ids must be shaped (batch, length); got shape {tuple(input_ids.shape)}{hint}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(
                f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; pass the tokenizer's ids "
                "(torch.long), or vectors as inputs_embeds"
            )
    else:
        name, tensor = "inputs_embeds", inputs_embeds
        if not isinstance(inputs_embeds, torch.Tensor):
            raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}")
        hidden = embeddings.word_embeddings.embedding_dim
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden:
            raise ValueError(
                f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; it must be (batch, length, hidden_size) with "
                f"this model's hidden_size={hidden}"
            )
        weight = embeddings.word_embeddings.weight.dtype
        if not inputs_embeds.is_floating_point():
            raise TypeError(f"inputs_embeds must be floating point, got dtype {inputs_embeds.dtype}")
        if inputs_embeds.dtype != weight and not torch.is_autocast_enabled(inputs_embeds.device.type):
            raise TypeError(
                f"inputs_embeds has dtype {inputs_embeds.dtype} but the model's weights are {weight}; cast them "
                f"with inputs_embeds.to({weight})"
            )
    shape = tuple(tensor.shape)
    if shape[0] == 0:
        raise ValueError(f"{name} has shape {shape}: no sequences to run; pass a batch of at least one sequence")
    if shape[1] == 0:
        raise ValueError(f"{name} has shape {shape}: no tokens to run; pass at least one token per sequence")
    return name, shape


# transformers 5.24 renamed the cache argument and output field from past_key_values to cache, and its generate()
# passes cache=; 5.23's passes past_key_values=. The models take either name and return the field the installed
# transformers declares, so generate() and user code work with both.
CACHE_FIELD = (
    "cache" if "cache" in BaseModelOutputWithPoolingAndCrossAttentions.__dataclass_fields__ else "past_key_values"
)


def _one_cache(cache, past_key_values):
    """The cache passed as ``cache`` or, under its older name, as ``past_key_values``."""
    if cache is not None and past_key_values is not None:
        raise ValueError(
            "got both cache and past_key_values: they name the same argument (transformers >= 5.24 calls it cache); "
            "pass the LinearAttentionCache once"
        )
    return cache if cache is not None else past_key_values


def _padding_mask(attention_mask, past: int, inputs: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The checked 0/1 padding mask of the cached and the new tokens, (batch, past + length), 1 = real token.

    ``inputs`` and ``shape`` name the input_ids / inputs_embeds it must fit. Values are checked in eager mode only:
    reading them under torch.compile would break the graph."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, dict):  # generate() may key masks by layer type
        attention_mask = next(iter(attention_mask.values()))
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be the 2-D (batch, length) padding mask with 1 for real tokens, got shape "
            f"{tuple(attention_mask.shape)}; linear attention takes no 4-D masks"
        )
    batch, length = shape[:2]
    if tuple(attention_mask.shape) != (batch, past + length):
        got = f"attention_mask has shape {tuple(attention_mask.shape)}"
        if past:
            raise ValueError(
                f"{got} but the cache holds {past} tokens and {inputs} has shape {shape}; with a cache the mask "
                f"covers the cached and the new tokens: pass shape ({batch}, {past + length})"
            )
        raise ValueError(
            f"{got} but {inputs} has shape {shape}; pass one entry per token, shape ({batch}, {length}), with 1 "
            "for real tokens and 0 for padding"
        )
    if attention_mask.dtype != torch.bool and not torch.compiler.is_compiling():
        bad = (attention_mask != 0) & (attention_mask != 1)
        if bool(bad.any()):
            value = attention_mask[bad][0].item()
            additive = attention_mask.is_floating_point() and value < 0
            raise ValueError(
                f"attention_mask must hold 0 (padding) and 1 (token); got values like {value}"
                + (": this looks like an additive mask; pass the 0/1 padding mask instead" if additive else "")
            )
        if attention_mask.is_floating_point() and not bool(attention_mask.any()):
            raise ValueError(
                "attention_mask is all 0.0, which marks every token as padding; if it is an additive mask "
                "(0 = attend), pass the 0/1 padding mask instead, or no mask"
            )
    return attention_mask


def _broadcast_ids(ids: torch.Tensor | None, name: str, inputs: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """token_type_ids / position_ids as (batch, length): given so, or as one (1, length) row for every sequence."""
    if ids is None:
        return None
    batch, length = shape[:2]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{name} must be an integer torch.Tensor, got {got}")
    if ids.dim() != 2 or ids.shape[1] != length or ids.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} has shape {tuple(ids.shape)} but {inputs} has shape {shape}; pass one per token, shape "
            f"({batch}, {length}) (or (1, {length}) for the same row in every sequence)"
        )
    return ids.expand(batch, length)


# never compiled: a forward that runs eagerly between compiled pieces (the kernels break the graph) calls it, and
# dynamo would compile it as a frame of its own, whose .tolist() breaks
@torch.compiler.disable
def _check_id_ranges(checks: list[tuple[torch.Tensor, str, int, str]]) -> None:
    """Raise when ids fall outside [0, size): the min and max of every (ids, name, size, fix) are read back in one
    host sync (one per forward, generate()'s steps included), instead of an IndexError deep inside nn.Embedding.
    ``size`` 0 checks only that ids are >= 0."""
    if not checks:
        return
    bounds = torch.stack([torch.stack(torch.aminmax(ids)).to(torch.long) for ids, *_ in checks]).tolist()
    for (low, high), (_, name, size, fix) in zip(bounds, checks):
        if low < 0 or (size and high >= size):
            limit = f", outside 0 .. {size - 1}" if size else "; they start at 0"
            raise ValueError(f"{name} hold {low if low < 0 else high}{limit}; {fix}")


def _key_mask(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The (batch, length) bool key-padding mask of the current tokens, or None when nothing is padded.

    Under torch.compile the mask is passed even when nothing is padded (the kernels treat an all-True mask as no
    mask): testing ``mask.all()`` would read a value and break the graph. Eager mode skips the masked path."""
    if mask is None:
        return None
    mask = mask[:, -length:].bool()
    if torch.compiler.is_compiling():
        return mask
    return None if bool(mask.all()) else mask


class LinearAttentionModel(LinearAttentionPreTrainedModel):
    """The bare stack: embeddings, N blocks of the family's ``attention_class``, and a final LayerNorm (decoder) or
    a pooler (encoder).

    Position ids default to each token's rank among its sequence's real tokens (cumsum of the attention mask),
    so left and right padding give the same answers. The family's model adds its own parts after this
    ``__init__`` and then calls ``post_init()``, so that they are initialized with the rest.
    """

    def __init__(self, config: LinearAttentionConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        # the construction-time checks again: fields may have been set one by one since (config.num_attention_heads
        # = 5 with hidden_size 768 fails here, naming both, rather than in a reshape)
        config.validate_architecture()
        # the longest input the tables built here take (the config's sequence_limit), read once: a forward asks the
        # config only to word the error
        limit = config.sequence_limit()
        self._length_limit = math.inf if limit is None else limit[0]
        self.embeddings = LinearAttentionEmbeddings(config)
        self.layers = nn.ModuleList(
            [LinearAttentionBlock(config, i, self.attention_class) for i in range(config.num_hidden_layers)]
        )
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.is_decoder else None
        self.pooler = LinearAttentionPooler(config) if add_pooling_layer and not config.is_decoder else None

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def _start_forward(self) -> None:
        """Called once per forward, after the inputs are checked and before the embeddings: the place for a
        family's per-forward bookkeeping (a schedule that counts forwards). Nothing for the shared stack."""

    def _check_id_ranges(self, input_ids, token_type_ids, position_ids) -> None:
        checks = []
        if input_ids is not None:
            size = self.embeddings.word_embeddings.num_embeddings
            fix = (
                f"this model's vocab_size={size}; check that the tokenizer belongs to this model (or "
                "resize_token_embeddings(len(tokenizer))), and that no label value such as -100 was passed as an id"
            )
            checks.append((input_ids, "input_ids", size, fix))
        types = self.embeddings.token_type_embeddings
        if token_type_ids is not None and types is not None:
            size = types.num_embeddings
            fix = f"this model's type_vocab_size={size}; pass segment ids from 0 (first segment) up to {size - 1}"
            checks.append((token_type_ids, "token_type_ids", size, fix))
        if position_ids is not None:
            fix = (
                "pass position_ids >= 0, or leave them out: by default they count each sequence's real tokens in "
                "the attention_mask"
            )
            checks.append((position_ids, "position_ids", 0, fix))
        _check_id_ranges(checks)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: LinearAttentionCache | None = None,
        use_cache: bool | None = None,
        past_key_values: LinearAttentionCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """Run the stack.

        Args:
            input_ids: (batch, length) token ids. Pass exactly one of input_ids and inputs_embeds.
            attention_mask: (batch, length) padding mask, 1 for real tokens and 0 for padding (bool or any
                integer / float dtype holding 0 and 1; not an additive or 4-D mask). None: no padding.
                With a cache: (batch, past + length), covering the cached and the new tokens.
            token_type_ids: (batch, length) segment ids in [0, type_vocab_size), or (1, length) for every sequence;
                default all 0. The decoder has no segment embeddings: it checks their shape and ignores them.
            position_ids: (batch, length) or (1, length) positions; default each token's rank among its sequence's
                real tokens (the cumulative sum of attention_mask), so left and right padding agree.
            inputs_embeds: (batch, length, hidden_size) vectors in place of input_ids' word embeddings.
            cache: decoder only, the LinearAttentionCache of earlier calls: the fixed-size recurrent state per
                layer (not keys and values). input_ids then holds only the new tokens.
            use_cache: decoder only; return the cache (default config.use_cache). In eval mode a new cache is built
                when none is passed.
            past_key_values: the older name of cache (transformers < 5.24 passes it); give one or the other.
            **kwargs: output_hidden_states=True adds every layer's hidden states; return_dict=False returns a
                tuple. output_attentions=True raises: linear attention never forms the n x n map.

        Returns:
            BaseModelOutputWithPoolingAndCrossAttentions: last_hidden_state (batch, length, hidden_size);
            pooler_output (batch, hidden_size), the encoder's [CLS] pooler (None for a decoder or without a
            pooler); the cache when caching (field ``cache`` with transformers >= 5.24, ``past_key_values``
            before); hidden_states when asked for.
        """
        if kwargs.get("output_attentions"):
            raise ValueError(NO_ATTENTION_MAPS)
        inputs, shape = _checked_inputs(input_ids, inputs_embeds, self.embeddings)
        batch, length = shape[:2]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        cache = _one_cache(cache, past_key_values)
        use_cache = bool(self.config.is_decoder and (self.config.use_cache if use_cache is None else use_cache))
        if use_cache and cache is None and not self.training:
            cache = LinearAttentionCache(self.config.num_hidden_layers)
        if cache is not None and not isinstance(cache, LinearAttentionCache):
            raise TypeError(
                f"the cache must be a LinearAttentionCache (linear attention keeps a fixed-size state, not keys and "
                f"values), got {type(cache).__name__}"
            )
        past = cache.get_seq_length() if cache is not None else 0
        cached_batch = cache.batch_size() if cache is not None else None
        if cached_batch is not None and cached_batch != batch:
            raise ValueError(
                f"the cache holds the state of a batch of {cached_batch} sequences, but {inputs} has a batch "
                f"of {batch} (shape {shape}); a cache continues the sequences it was built with. Continue with the "
                "same batch, or start over without a cache."
            )
        if past + length > self._length_limit:  # host ints only
            self.config.check_input_length(length, past=past)  # raises, naming the field that sets the limit
        attention_mask = _padding_mask(attention_mask, past, inputs, shape)
        token_type_ids = _broadcast_ids(token_type_ids, "token_type_ids", inputs, shape)
        position_ids = _broadcast_ids(position_ids, "position_ids", inputs, shape)
        if not torch.compiler.is_compiling():  # data-dependent checks would break the compiled graph
            self._check_id_ranges(input_ids, token_type_ids, position_ids)
        key_mask = _key_mask(attention_mask, length)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -length:]
            else:
                position_ids = torch.arange(past, past + length, device=device).expand(batch, -1)
        self._start_forward()
        hidden_states = self.embeddings(input_ids, position_ids, token_type_ids, inputs_embeds)
        position_embeddings = None
        if self.config.position_embedding_type == "rotary":
            position_embeddings = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=key_mask,
                position_embeddings=position_embeddings,
                past_key_values=cache,
                position_ids=position_ids,
            )
        if cache is not None:
            cache.seen_tokens += length
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
        pooled = self.pooler(hidden_states, key_mask) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden_states,
            pooler_output=pooled,
            **{CACHE_FIELD: cache if use_cache else None},
        )


class LinearAttentionForMaskedLM(LinearAttentionPreTrainedModel):
    """BERT's masked-LM head (dense, activation, LayerNorm, decoder tied to the word embeddings) on the encoder
    stack, without a pooler. Needs ``is_decoder=False``."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: LinearAttentionConfig):
        super().__init__(config)
        if config.is_decoder:
            raise ValueError(f"{type(self).__name__} needs a bidirectional encoder config; got is_decoder=True")
        self.model = self.base_model_class(config, add_pooling_layer=False)
        self.lm_head = MaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """Masked-LM logits, and the loss when labels are given.

        Args:
            input_ids: (batch, length) token ids. Pass exactly one of input_ids and inputs_embeds.
            attention_mask: (batch, length) padding mask, 1 for real tokens and 0 for padding (bool or any
                integer / float dtype holding 0 and 1; not an additive or 4-D mask). None: no padding.
            token_type_ids: (batch, length) segment ids in [0, type_vocab_size), or (1, length) for every sequence;
                default all 0. The decoder has no segment embeddings: it checks their shape and ignores them.
            position_ids: (batch, length) or (1, length) positions; default each token's rank among its sequence's
                real tokens (the cumulative sum of attention_mask), so left and right padding agree.
            inputs_embeds: (batch, length, hidden_size) vectors in place of input_ids' word embeddings.
            labels: (batch, length) token ids to predict at the masked positions, -100 elsewhere (ignored by the
                cross-entropy), as DataCollatorForLanguageModeling makes them.
            **kwargs: output_hidden_states=True adds every layer's hidden states; return_dict=False returns a
                tuple. output_attentions=True raises: linear attention never forms the n x n map.

        Returns:
            MaskedLMOutput: logits (batch, length, vocab_size); loss (scalar) when labels are given.
        """
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


def _uncached_length(input_ids, inputs_embeds, attention_mask, position_ids, past: int) -> int | None:
    """How many trailing tokens of generate()'s prefill inputs the cache has not seen (``past`` tokens seen), or
    None when the inputs are the new tokens alone.

    transformers' rule: ``inputs_embeds`` always hold the full sequence; ``input_ids`` do when they are as long as
    the attention mask. generate() drops an all-ones mask before the prefill; the position ids it built from the
    mask keep its length, and start at 0 for the full sequence (a chunked prefill passes each later chunk, new
    tokens, with its own positions and no mask).
    """
    if inputs_embeds is not None:
        name, length, full = "inputs_embeds", inputs_embeds.shape[1], True
    else:
        name, length = "input_ids", input_ids.shape[1]
        if isinstance(attention_mask, torch.Tensor):
            full = attention_mask.shape[-1] == length
        elif position_ids is not None:
            full = position_ids.shape[-1] == length and not bool(position_ids[..., 0].any())
        else:
            full = True
    if not full:
        return None
    if length <= past:
        raise ValueError(
            f"generate() got {name} of length {length} and a cache that holds {past} tokens: to continue a cache, pass "
            f"the full sequence (the cached tokens and the new ones, e.g. generate(out.sequences, cache=out.cache)), or "
            f"the new tokens with an attention_mask of shape (batch, {past} + new tokens)"
        )
    return length - past


class LinearAttentionForCausalLM(LinearAttentionPreTrainedModel, GenerationMixin):
    """GPT-2-style causal LM: the pre-LN decoder stack (``is_decoder=True``) and an LM head tied to the word
    embeddings. ``generate()`` decodes from a LinearAttentionCache, a fixed-size recurrent state per layer, so
    each new token costs the same at any context length."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.word_embeddings.weight"}
    _is_stateful = True  # a recurrent state cannot be cropped: no assisted decoding

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the recurrent cache has no sequence length; forward builds a LinearAttentionCache

    def __init__(self, config: LinearAttentionConfig):
        super().__init__(config)
        if not config.is_decoder:
            raise ValueError(
                f"{type(self).__name__} needs a causal decoder config: pass is_decoder=True "
                f"(e.g. {type(config).__name__}(is_decoder=True, ...)) to build the GPT-2-style pre-LN stack"
            )
        self.model = self.base_model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs,
    ) -> dict:
        """transformers' inputs for one forward of ``generate()``, with the prefill cut to its uncached tokens.

        ``generate()`` continues a cache from the full sequence, ``generate(out.sequences, cache=out.cache)`` (or
        ``inputs_embeds`` of the full sequence), or from the new tokens with an ``attention_mask`` covering the
        cached and the new ones. transformers 5.23 cuts the full sequence to its uncached tail in the prefill; 5.24
        does not when every cache layer is linear, and the tokens already in the state would be fed a second
        time. So the rule is applied here, the same on both: the first forward gets the tokens the cache has not
        seen.
        """
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if is_first_iteration and isinstance(cache, LinearAttentionCache) and cache.get_seq_length():
            next_sequence_length = _uncached_length(
                input_ids, inputs_embeds, attention_mask, kwargs.get("position_ids"), cache.get_seq_length()
            )
        return super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LinearAttentionCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        token_type_ids: torch.LongTensor | None = None,
        past_key_values: LinearAttentionCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Next-token logits, and the loss when labels are given; generate() calls this step by step.

        Args:
            input_ids: (batch, length) token ids. Pass exactly one of input_ids and inputs_embeds.
            attention_mask: (batch, length) padding mask, 1 for real tokens and 0 for padding (bool or any
                integer / float dtype holding 0 and 1; not an additive or 4-D mask). None: no padding.
                With a cache: (batch, past + length), covering the cached and the new tokens.
            token_type_ids: (batch, length) segment ids in [0, type_vocab_size), or (1, length) for every sequence;
                default all 0. The decoder has no segment embeddings: it checks their shape and ignores them.
            position_ids: (batch, length) or (1, length) positions; default each token's rank among its sequence's
                real tokens (the cumulative sum of attention_mask), so left and right padding agree.
            inputs_embeds: (batch, length, hidden_size) vectors in place of input_ids' word embeddings.
            cache: the LinearAttentionCache returned by the previous call (the recurrent state of every layer, a
                fixed size whatever the context length); input_ids then holds only the new tokens.
            labels: (batch, length) token ids, usually input_ids itself; shifted inside (position t predicts token
                t + 1). -100 is ignored.
            use_cache: return the cache (default config.use_cache; in eval mode a new cache is built when none is
                passed).
            past_key_values: the older name of cache (transformers < 5.24's generate() passes it); give one or
                the other.
            logits_to_keep: compute logits for the last this many positions only (0: all), or a tensor of the
                positions to keep.
            **kwargs: output_hidden_states=True adds every layer's hidden states; return_dict=False returns a
                tuple. output_attentions=True raises: linear attention never forms the n x n map.

        Returns:
            CausalLMOutputWithPast: logits (batch, length or logits_to_keep, vocab_size); loss (scalar) when
            labels are given; the cache when caching (field ``cache`` with transformers >= 5.24,
            ``past_key_values`` before).
        """
        # WordPiece tokenizers return token_type_ids, and generate(**tokenizer(text, return_tensors="pt")) passes
        # them on: accepted here (checked for shape), and unused, since the GPT-2-style stack has no segment
        # embeddings
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            cache=cache,
            past_key_values=past_key_values,  # the stack settles the two names
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )


class LinearAttentionForSequenceClassification(LinearAttentionPreTrainedModel):
    """Pools like the stack it sits on: BERT's [CLS] pooler for the encoder, the last real token for a decoder.
    Single-label, multi-label and regression follow ``config.problem_type`` (transformers' loss)."""

    # the loss is a per-example mean that ignores num_items_in_batch: Trainer must scale it for gradient
    # accumulation itself (with **kwargs in forward it would assume the loss already did, and steps would be N x)
    accepts_loss_kwargs = False

    def __init__(self, config: LinearAttentionConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        """Class logits of each sequence, and the loss when labels are given.

        Args:
            input_ids: (batch, length) token ids. Pass exactly one of input_ids and inputs_embeds.
            attention_mask: (batch, length) padding mask, 1 for real tokens and 0 for padding (bool or any
                integer / float dtype holding 0 and 1; not an additive or 4-D mask). None: no padding.
            token_type_ids: (batch, length) segment ids in [0, type_vocab_size), or (1, length) for every sequence;
                default all 0. The decoder has no segment embeddings: it checks their shape and ignores them.
            position_ids: (batch, length) or (1, length) positions; default each token's rank among its sequence's
                real tokens (the cumulative sum of attention_mask), so left and right padding agree.
            inputs_embeds: (batch, length, hidden_size) vectors in place of input_ids' word embeddings.
            labels: (batch,) int class ids for single-label classification (or regression with num_labels=1:
                float targets); (batch, num_labels) float 0/1 for multi-label. config.problem_type picks the loss,
                as in transformers (inferred from num_labels and the labels' dtype when unset).
            **kwargs: output_hidden_states=True adds every layer's hidden states; return_dict=False returns a
                tuple. output_attentions=True raises: linear attention never forms the n x n map.

        Returns:
            SequenceClassifierOutput: logits (batch, num_labels); loss (scalar) when labels are given.
        """
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            return_dict=True,
            **kwargs,
        )
        if outputs.pooler_output is not None:
            pooled = outputs.pooler_output
        else:
            hidden = outputs.last_hidden_state
            real = attention_mask
            if real is None and input_ids is not None and self.config.pad_token_id is not None:
                real = input_ids != self.config.pad_token_id  # as transformers' decoder heads do
            if real is None:
                last = torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device)
            else:  # rightmost real token, for left or right padding
                positions = torch.arange(hidden.shape[1], device=hidden.device)
                last = (positions * real.to(hidden.device).long()).argmax(-1)
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


class LinearAttentionForMultipleChoice(LinearAttentionPreTrainedModel):
    """BERT's multiple-choice head: each (context, choice) pair is encoded, pooled and scored; softmax over
    choices. Inputs are (batch, num_choices, length)."""

    accepts_loss_kwargs = False  # a mean over examples, as for sequence classification

    def __init__(self, config: LinearAttentionConfig):
        super().__init__(config)
        if config.is_decoder:
            raise ValueError(f"{type(self).__name__} needs a bidirectional encoder config; got is_decoder=True")
        self.model = self.base_model_class(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> MultipleChoiceModelOutput:
        """One score per choice, and the loss when labels are given.

        Args:
            input_ids: (batch, num_choices, length) token ids of each (context, choice) pair. Pass exactly one of
                input_ids and inputs_embeds.
            attention_mask: (batch, num_choices, length) padding mask, 1 for real tokens and 0 for padding.
            token_type_ids: (batch, num_choices, length) segment ids (context 0, choice 1).
            position_ids: (batch, num_choices, length) positions; default from attention_mask.
            inputs_embeds: (batch, num_choices, length, hidden_size) vectors in place of input_ids.
            labels: (batch,) index of the right choice in [0, num_choices).
            **kwargs: output_hidden_states=True adds every layer's hidden states; return_dict=False returns a
                tuple. output_attentions=True raises: linear attention never forms the n x n map.

        Returns:
            MultipleChoiceModelOutput: logits (batch, num_choices); loss (scalar) when labels are given.
        """
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError("multiple choice inputs must be shaped (batch, num_choices, length)")
        num_choices = source.shape[1]

        def flat(x):
            return None if x is None else x.reshape(-1, *x.shape[2:])

        outputs = self.model(
            flat(input_ids),
            attention_mask=flat(attention_mask),
            token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids),
            inputs_embeds=flat(inputs_embeds),
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output)).view(-1, num_choices)
        loss = None
        if labels is not None:
            # transformers' loss_function has no multiple-choice entry
            loss = nn.functional.cross_entropy(logits.float(), labels.to(logits.device))
        return MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


def _classifier_dropout(config) -> float:
    """BERT's rule: classifier_dropout, else hidden_dropout_prob."""
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class LinearAttentionForTokenClassification(GenericForTokenClassification):
    """transformers' generic token-classification head (forward and weight names ``model``, ``score``), with the
    stack built from ``base_model_class`` rather than ``AutoModel.from_config``: from exported remote code that
    call would need ``trust_remote_code`` again and fail. Dropout follows BERT (classifier_dropout, else
    hidden_dropout_prob). No pooler, as in BERT's head: an unused one gets no gradient, which breaks plain DDP.

    ``forward`` is the generic one (its docstring is transformers'): input_ids / attention_mask / position_ids
    (batch, length), inputs_embeds (batch, length, hidden_size), labels (batch, length) class ids with -100
    ignored; token_type_ids (batch, length) pass through its ``**kwargs``. past_key_values and use_cache are for
    a decoder stack only. Returns a TokenClassifierOutput with logits (batch, length, num_labels)."""

    # the generic loss is a mean that ignores num_items_in_batch: Trainer must scale it for gradient accumulation
    # itself (with **kwargs in forward it would assume the loss already did, and steps would be N x)
    accepts_loss_kwargs = False

    def __init__(self, config: LinearAttentionConfig):
        super(GenericForTokenClassification, self).__init__(config)  # the PreTrainedModel, not the generic init
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class LinearAttentionForQuestionAnswering(GenericForQuestionAnswering):
    """transformers' generic extractive-QA head (``model``, ``qa_outputs``), with the stack built from
    ``base_model_class`` and no pooler (see LinearAttentionForTokenClassification).

    ``forward`` is the generic one (its docstring is transformers'): input_ids / attention_mask / position_ids
    (batch, length), inputs_embeds (batch, length, hidden_size), start_positions / end_positions (batch,) token
    indices of the answer span (clamped to the sequence); token_type_ids (batch, length) pass through its
    ``**kwargs``. Returns a QuestionAnsweringModelOutput with start_logits and end_logits (batch, length)."""

    def __init__(self, config: LinearAttentionConfig):
        super(GenericForQuestionAnswering, self).__init__(config)
        self.model = self.base_model_class(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)
