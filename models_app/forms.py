"""Admin forms: registering a model (folder suggestions, source validation), its aliases, and API keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.utils.html import format_html, format_html_join

from models_app import selectors, services
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
)  # fmt: skip
ALIAS_FORM_FIELDS = (
    "name", "description", "model", "enabled",
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens",
    "max_output_tokens", "max_input_tokens", "enable_thinking", "chat_template_kwargs",
)  # fmt: skip
FOLDERS_FOUND_HELP = (
    "A folder relative to MODELS_ROOT. Suggested: the {count} folder(s) there that look like "
    "mlx-lm models (config.json and *.safetensors, up to two levels down)."
)
NO_FOLDERS_HELP = (
    "A folder relative to MODELS_ROOT. None there looks like an mlx-lm model yet "
    "(config.json and *.safetensors, up to two levels down); or use a Hugging Face repo id below."
)
SOURCE_HELP = "A folder under MODELS_ROOT, or a Hugging Face repo id with a pinned revision."
API_KEY_ONCE_HELP = "The full key is shown once, right after you save; only its prefix is kept readable."


class DatalistInput(forms.TextInput):
    """A text box that suggests values through an HTML <datalist> (no JavaScript needed)."""

    def __init__(self, options: list[str], attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs={"class": "vTextField", **(attrs or {})})
        self.options = options

    def render(
        self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None
    ) -> SafeString:
        list_id = f"{(attrs or {}).get('id') or name}_choices"
        html = super().render(name, value, {**(attrs or {}), "list": list_id}, renderer)
        options = format_html_join("", '<option value="{}"></option>', ((option,) for option in self.options))
        return format_html('{}<datalist id="{}">{}</datalist>', html, list_id, options)


class ModelForm(_ModelFormBase):
    """Registers or edits a model; the weights source is checked before the admin saves it."""

    class Meta:
        model = Model
        fields = MODEL_FORM_FIELDS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        local_path = self.fields.get("local_path")
        if local_path is not None:  # absent when the admin shows the page read-only
            folders = selectors.model_folders_available()
            local_path.widget = DatalistInput(folders)
            local_path.help_text = (
                FOLDERS_FOUND_HELP.format(count=len(folders)) if folders else NO_FOLDERS_HELP
            )
        if "source_kind" in self.fields:
            self.fields["source_kind"].help_text = SOURCE_HELP
        if "kind" in self.fields:  # a local folder's kind is detected on save (API-13)
            self.fields["kind"].required = False

    def clean_kind(self) -> str:
        kind: str = self.cleaned_data.get("kind") or Model.Kind.CHAT
        return kind

    def clean(self) -> dict[str, Any]:
        super().clean()  # ModelForm's returns self.cleaned_data; the stubs allow None (a subclass may)
        cleaned = self.cleaned_data
        if not self.errors:
            for field, value in cleaned.items():
                setattr(self.instance, field, value)
            # Folder safety (MODELS_ROOT, remote code, weights) or a pinned revision, keyed by the
            # offending field, before save_model runs.
            services.model_source_check(model=self.instance)
        return cleaned


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
        widgets = {
            "enable_thinking": ThinkingSelect(),
            "chat_template_kwargs": forms.Textarea(attrs={"rows": 2, "cols": 60, "class": "vLargeTextField"}),
        }


class ApiKeyCreateForm(_ApiKeyFormBase):
    class Meta:
        model = ApiKey
        fields = ("owner", "name")
        help_texts = {"name": API_KEY_ONCE_HELP}
