"""Chat templates posttrain ships, chosen by name where a user sets one (`model.chat_template`, `LLM(chat_template=)`).

    chatml_tools    ChatML with tools (Hermes / Qwen2.5 convention) for the default model, whose own template
                    has none: tool schemas in the system turn, <tool_call> JSON in assistant turns, tool
                    results as <tool_response> blocks in a user turn. Parsed back by the `hermes` tool-call
                    parser (posttrain.envs.tool_calls). docs/agents.md shows a rendered conversation.

A spec is one of these names or a path to a Jinja file (e.g. a model's chat_template.jinja).
"""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import ConfigError

TEMPLATE_DIR = Path(__file__).resolve().parent
CHAT_TEMPLATES = {"chatml_tools": TEMPLATE_DIR / "chatml_tools.jinja"}


def load_chat_template(spec: str, key: str = "chat_template") -> str:
    """The template source `spec` names (a built-in name or a .jinja path); `key` names the setting in errors."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{key}: expected a template name or a .jinja path, got {spec!r}")
    path = CHAT_TEMPLATES.get(spec) or Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{key}: {spec!r} is neither a built-in template ({', '.join(CHAT_TEMPLATES)}) nor an existing file"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{key}: cannot read {path} ({error})") from None
