"""``python -m workers.engine``: help, a real generation streamed to stdout, and bad flags."""

import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "workers.engine", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout and "bench" in result.stdout
    result = run_cli("generate", "--help")
    assert result.returncode == 0
    for flag in ("--chat", "--max-tokens", "--temperature", "--top-p", "--seed", "--stop"):
        assert flag in result.stdout


@pytest.mark.slow
def test_generate_streams_text_and_reports_timings():
    result = run_cli("generate", "--chat", "Say hi.", "--max-tokens", "4", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "TTFT" in result.stderr and "completion tokens" in result.stderr


@pytest.mark.slow
def test_generate_json_prints_a_json_object(tmp_path):
    import json

    result = run_cli("generate", "--chat", "Give a cat's name and age as a short JSON object.", "--max-tokens", "120",
                     "--dtype", "float32", "--json")
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), dict), result.stdout


@pytest.mark.slow
def test_generate_with_required_tools_prints_a_call(tmp_path):
    import json

    from workers.engine.tool_calls import parse_tool_calls

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                                              "required": ["city"], "additionalProperties": False}}}]))
    result = run_cli("generate", "--chat", "Weather in Oslo?", "--max-tokens", "60", "--dtype", "float32",
                     "--tools", str(tools), "--tool-choice", "required")
    assert result.returncode == 0, result.stderr
    text, calls = parse_tool_calls(result.stdout.strip())
    assert text == "" and calls and all(c["name"] == "get_weather" for c in calls), result.stdout
    assert set(json.loads(calls[0]["arguments"])) == {"city"}


@pytest.mark.parametrize("args, message", [
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate"], "prompt"),
    (["generate", "x", "--chat", "y"], "prompt"),
    (["generate", "x", "--json-schema", "/nonexistent/schema.json"], "--json-schema"),
    (["generate", "x", "--tools", "/nonexistent/tools.json"], "--tools"),
    (["generate", "x", "--tool-choice", "required"], "tool_choice"),
])
def test_bad_flags_are_explained(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
