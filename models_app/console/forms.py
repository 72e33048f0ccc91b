"""Admin forms: registering a model (folder suggestions, source validation), its aliases, and API keys.

Every field of the model and alias forms has a human label and help text saying its range and
what an empty value means (ADM-7); the texts live here, not on the model fields, so that wording
changes need no migration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.core.exceptions import ValidationError
from django.utils.html import format_html, format_html_join

from mlxhost.engine import ALIAS_SAMPLING_FIELDS
from models_app.catalogue import services
from models_app.catalogue.adapters import adapter_base_error
from models_app.catalogue.drafts import model_draft_check
from models_app.catalogue.folders import model_folders_available
from models_app.models import ApiKey, Model, ModelAlias

if TYPE_CHECKING:
    from django.utils.safestring import SafeString

    # django-stubs makes ModelForm generic over its model, but Django's class is not subscriptable
    # at runtime (django_stubs_ext.monkeypatch would make it so; it is a dev-only package here).
    _ModelFormBase = forms.ModelForm[Model]
    _ModelAliasFormBase = forms.ModelForm[ModelAlias]
    _ApiKeyFormBase = forms.ModelForm[ApiKey]
else:
    _ModelFormBase = _ModelAliasFormBase = _ApiKeyFormBase = forms.ModelForm

MODEL_FORM_FIELDS = (
    "name", "description", "pinned",
    "source_kind", "local_path", "hf_repo", "hf_revision", "kind", "matryoshka",
    "concurrency", "queue_depth", "queue_unbounded", "queue_timeout_s", "keep_alive_s",
    "kv_bits", "kv_group_size", "kv_quantized_start",
    "draft_model",
)  # fmt: skip
ALIAS_FORM_FIELDS = (
    "name", "description", "model", "adapter", "enabled",
    *ALIAS_SAMPLING_FIELDS,
    "max_output_tokens", "max_input_tokens", "enable_thinking", "chat_template_kwargs",
    "speculation", "speculation_max_k",
)  # fmt: skip
FOLDERS_FOUND_HELP = (
    "A folder relative to MODELS_ROOT, for a local source. Found there: the {count} folder(s) that look "
    "like mlx-lm models (config.json and *.safetensors, up to two levels down); click one or type a path."
)
NO_FOLDERS_HELP = (
    "A folder relative to MODELS_ROOT, for a local source. None there looks like an mlx-lm model yet "
    "(config.json and *.safetensors, up to two levels down); or use a Hugging Face repo id below."
)
API_KEY_CREATE_FIELDS = ("owner", "name", "requests_per_minute", "tokens_per_day")
API_KEY_CHANGE_FIELDS = ("name", "requests_per_minute", "tokens_per_day")
SOURCE_HELP = "A folder under MODELS_ROOT, or a Hugging Face repo id at a revision (pinned to its commit)."
API_KEY_ONCE_HELP = (
    "A label for people, such as the machine or app that uses the key. The full key is shown "
    "once, right after you save; only its prefix is kept readable."
)
MAX_TOKENS_OVER_CLAMP = "The default ({default}) is above the clamp ({clamp}): raise the clamp or lower this."
SOURCE_FIELDS = ("source_kind", "local_path", "hf_repo", "hf_revision")
MAX_SUGGESTIONS = 30  # folders shown under the field; the datalist offers them all

KV_FIELDS = ("kv_bits", "kv_group_size", "kv_quantized_start")  # checked with the folder they apply to
MODEL_LABELS = {
    "name": "Name",
    "description": "Description",
    "pinned": "Pinned (always loaded)",
    "source_kind": "Weights come from",
    "local_path": "Folder",
    "hf_repo": "Hugging Face repo id",
    "hf_revision": "Revision",
    "concurrency": "Concurrent requests",
    "queue_depth": "Queue depth",
    "queue_unbounded": "Unbounded queue",
    "queue_timeout_s": "Queue timeout (seconds)",
    "keep_alive_s": "Keep-alive (idle seconds)",
    "kv_bits": "KV cache bits",
    "kv_group_size": "KV group size",
    "kv_quantized_start": "KV quantized from token",
    "draft_model": "Draft model",
}
MODEL_HELP = {
    "name": "A slug for staff (letters, digits, - and _; up to 64). Clients never see it: they use aliases.",
    "description": "Optional, up to 200 characters: a note for staff.",
    "pinned": "Load at server start and never free for idleness or the memory budget. Off: loads on first "
    "use and is freed after the keep-alive.",
    "source_kind": SOURCE_HELP,
    "local_path": NO_FOLDERS_HELP,
    "hf_repo": "For a hub source: owner/name, such as mlx-community/SmolLM2-135M-Instruct. Empty for a folder.",
    "hf_revision": "For a hub source: a branch, tag or commit (empty: main). Saving pins the commit it "
    "names now, which is what loads: a branch that moves later changes nothing until you use the "
    "Update action. Empty for a folder.",
    "concurrency": "1 to 64. 1 runs one request at a time (exclusive); more runs them batched. Every alias "
    "of this model shares these slots. A model that cannot batch (its KV cache cannot merge "
    "sequences) is served one request at a time whatever this says, and its page says so.",
    "queue_depth": "0 or more (default 16): requests that may wait for a slot; one more is refused at once "
    "(429, or 529 on the Anthropic surface).",
    "queue_unbounded": "Let any number of requests wait; the queue depth is then ignored.",
    "queue_timeout_s": "0.1 or more: a request waiting longer gets 503. Empty: it waits as long as it takes.",
    "keep_alive_s": "0 or more (default 1800, half an hour): free the memory after this long without a "
    "request; the next request loads it again. Empty: never free it for idleness.",
    "kv_bits": "Empty (default): the KV cache keeps the activations' precision. 8 or 4: it is quantized, so "
    "the same KV budget holds about 3.5x (8 bits) or 6x (4 bits) the cached tokens of float32, at some "
    "cost in exactness. Batching, the prefix cache and the disk tier keep it quantized. Changing it "
    "makes a new instance (a hot swap): KV of one format is never reused under another. Chat models only.",
    "kv_group_size": "32, 64 (default) or 128 numbers per scale, along the model's head dimension, which it "
    "must divide (the model fails to load with a message otherwise). Smaller groups are more exact.",
    "kv_quantized_start": "0 or more (default 0): a request served alone (concurrency 1) keeps full "
    "precision until it holds this many tokens, as mlx-lm's quantized_kv_start. A batch quantizes "
    "every row from its first token.",
    "draft_model": "Optional: a smaller chat model with the same tokenizer (the same vocabulary, checked "
    "when you save and at load). It drafts tokens that this model checks several at a time, for "
    "aliases with speculation on: the same text, sooner where the draft guesses right. Loaded and "
    "freed with this model. Empty: drafts come from prompt lookup and predictions only.",
}
ALIAS_LABELS = {
    "name": "Name (what clients send as model)",
    "description": "Description",
    "model": "Model",
    "adapter": "LoRA adapter",
    "enabled": "Enabled",
    "temperature": "Temperature",
    "top_p": "Top p",
    "top_k": "Top k",
    "min_p": "Min p",
    "repetition_penalty": "Repetition penalty",
    "max_tokens": "Default output tokens",
    "max_output_tokens": "Output token clamp",
    "max_input_tokens": "Input token limit",
    "enable_thinking": "Thinking",
    "chat_template_kwargs": "Chat template options",
    "speculation": "Speculative decoding",
    "speculation_max_k": "Most drafted tokens per step",
}
ALIAS_HELP = {
    "name": "A slug (letters, digits, - and _; up to 64), unique: clients put it in the request's model.",
    "description": "Optional, up to 200 characters: a note for staff.",
    "model": "The weights, lane and memory policy that serve this name; aliases of one model share them.",
    "adapter": "Optional: one of the model's LoRA adapters (Adapters page), applied to this name's requests. "
    "The base stays loaded and serves its other aliases; rows of every adapter and of none share one batch. "
    "Empty: the base alone.",
    "enabled": "Off: requests for this name get 404, and /v1/models leaves it out.",
    "temperature": "0 to 2 (default 0.7), when the request gives none. 0 always picks the likeliest token.",
    "top_p": "0 to 1 (default 1, off): sample only from the likeliest tokens whose probabilities add up to this.",
    "top_k": "0 or more (default 0, off): sample only from this many likeliest tokens.",
    "min_p": "0 to 1 (default 0, off): drop tokens less likely than this share of the likeliest one.",
    "repetition_penalty": "0.01 or more; 1 changes nothing, above 1 discourages repeats. Empty: off.",
    "max_tokens": "1 or more (default 512), at most the clamp: the output length when a request asks none.",
    "max_output_tokens": "1 or more (default 4096): no request may generate more, whatever it asks.",
    "max_input_tokens": "1 or more: prompts longer than this are refused with 400. Empty: only the model's "
    "context length limits them.",
    "enable_thinking": "For reasoning models: On lets the model think before it answers (its reasoning is "
    "sent apart from the answer), Off turns thinking off. A request may still choose with Anthropic's "
    "thinking parameter. Models without thinking markers ignore it.",
    "chat_template_kwargs": "A JSON object of at most 16 keywords for the chat template, such as "
    '{"reasoning_effort": "low"}. Empty ({}): none.',
    "speculation": "On (default): each decode step may draft tokens from the request's own prompt and "
    "output, or from its prediction (OpenAI Predicted Outputs), and check them in one pass. Greedy and "
    "seeded text stays the same; only the speed changes. Off: one token per step.",
    "speculation_max_k": "1 to 16 (default 16): the most tokens drafted for one request in one step (prompt lookup drafts at most 8, a prediction up to 16).",
}


class DatalistInput(forms.TextInput):
    """A text box that suggests values through an HTML <datalist>, and lists them visibly below it:
    plain text without JavaScript, buttons that fill the box with it (mlxhost/model_form.js)."""

    def __init__(self, options: list[str], attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs={"class": "vTextField", **(attrs or {})})
        self.options = options

    def render(
        self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None
    ) -> SafeString:
        list_id = f"{(attrs or {}).get('id') or name}_choices"
        html = super().render(name, value, {**(attrs or {}), "list": list_id}, renderer)
        options = format_html_join("", '<option value="{}"></option>', ((option,) for option in self.options))
        return format_html(
            '{}<datalist id="{}">{}</datalist>{}', html, list_id, options, self._suggestions(attrs, name)
        )

    def _suggestions(self, attrs: dict[str, Any] | None, name: str) -> SafeString | str:
        if not self.options:
            return ""
        target = (attrs or {}).get("id") or name
        shown = self.options[:MAX_SUGGESTIONS]
        buttons = format_html_join(
            " ",
            '<button type="button" class="mlxhost-suggestion" data-fill="{}" value="{}">{}</button>',
            ((target, option, option) for option in shown),
        )
        more = len(self.options) - len(shown)
        rest = format_html(" and {} more: type to filter", more) if more > 0 else ""
        return format_html(
            '<div class="mlxhost-suggestions" id="{}_suggestions"><span class="mlxhost-muted">Found:</span> {}{}</div>',
            target,
            buttons,
            rest,
        )


class ModelForm(_ModelFormBase):
    """Registers or edits a model; the weights source is checked before the admin saves it."""

    class Meta:
        model = Model
        fields = MODEL_FORM_FIELDS
        labels = MODEL_LABELS
        help_texts = MODEL_HELP

    class Media:
        js = ("mlxhost/model_form.js",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        local_path = self.fields.get("local_path")
        if local_path is not None:  # absent when the admin shows the page read-only
            folders = model_folders_available()
            local_path.widget = DatalistInput(folders)
            local_path.help_text = (
                FOLDERS_FOUND_HELP.format(count=len(folders)) if folders else NO_FOLDERS_HELP
            )
        if "source_kind" in self.fields:
            self.fields["source_kind"].help_text = SOURCE_HELP
        if "kind" in self.fields:  # a local folder's kind is detected on save (API-13)
            self.fields["kind"].required = False
        draft = self.fields.get("draft_model")
        if isinstance(draft, forms.ModelChoiceField):  # chat models other than this one
            draft.queryset = Model.objects.filter(kind=Model.Kind.CHAT).exclude(pk=self.instance.pk)

    def clean_kind(self) -> str:
        kind: str = self.cleaned_data.get("kind") or Model.Kind.CHAT
        return kind

    def clean(self) -> dict[str, Any]:
        super().clean()  # ModelForm's returns self.cleaned_data; the stubs allow None (a subclass may)
        cleaned = self.cleaned_data
        # Folder safety (MODELS_ROOT, remote code, weights) or a pinned revision, keyed by the
        # offending field, before save_model runs; checked whatever else is wrong, so the page
        # shows every error at once.
        if all(field in cleaned for field in SOURCE_FIELDS):
            for field in (*SOURCE_FIELDS, *KV_FIELDS):
                if field in cleaned:
                    setattr(self.instance, field, cleaned[field])
            try:
                services.model_source_check(model=self.instance)
            except ValidationError as exc:
                self.add_error(None, exc)
            else:
                self._check_draft(cleaned)
        return cleaned

    def _check_draft(self, cleaned: dict[str, Any]) -> None:
        if "draft_model" not in cleaned:
            return
        self.instance.draft_model = cleaned["draft_model"]
        try:
            model_draft_check(model=self.instance)
        except ValidationError as exc:
            self.add_error(None, exc)


class ThinkingSelect(forms.NullBooleanSelect):
    """The alias's thinking switch, in words: the model's default, on or off."""

    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs)
        self.choices = [("unknown", "The model's default"), ("true", "On"), ("false", "Off")]


class ModelAliasForm(_ModelAliasFormBase):
    """Registers or edits an alias: a public name, its sampling and limits, and its model."""

    class Meta:
        model = ModelAlias
        fields = ALIAS_FORM_FIELDS
        labels = ALIAS_LABELS
        help_texts = ALIAS_HELP
        widgets = {
            "enable_thinking": ThinkingSelect(),
            "chat_template_kwargs": forms.Textarea(attrs={"rows": 2, "cols": 60, "class": "vLargeTextField"}),
        }

    def clean(self) -> dict[str, Any]:
        super().clean()
        cleaned = self.cleaned_data
        default, clamp = cleaned.get("max_tokens"), cleaned.get("max_output_tokens")
        if default is not None and clamp is not None and default > clamp:
            # On the field, in words, and with the other errors (the table constraint says it too late).
            self.add_error("max_tokens", MAX_TOKENS_OVER_CLAMP.format(default=default, clamp=clamp))
        if (error := adapter_base_error(cleaned.get("adapter"), cleaned.get("model"))) is not None:
            self.add_error("adapter", error)  # an adapter of another model (issue 28)
        return cleaned


class ApiKeyCreateForm(_ApiKeyFormBase):
    """A new key: whose, a name to recognise it by, and its optional limits (KEY-1, KEY-4)."""

    class Meta:
        model = ApiKey
        fields = API_KEY_CREATE_FIELDS
        help_texts = {"name": API_KEY_ONCE_HELP}


class ApiKeyChangeForm(_ApiKeyFormBase):
    """An existing key: its name and limits; the secret and the owner never change."""

    class Meta:
        model = ApiKey
        fields = API_KEY_CHANGE_FIELDS
