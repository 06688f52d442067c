"""``--config FILE``: a YAML file of options for ``generate``, ``serve``, ``chat`` and ``bench``,
keys named as the flags (dashes or underscores), values checked and converted as the flags'
are; the command line wins; a bad file is a typed error with exit status 2 and one line."""

from __future__ import annotations

import pytest

from metrale.entrypoints.cli import main, parse_arguments


def write(tmp_path, text):
    path = tmp_path / "options.yaml"
    path.write_text(text)
    return str(path)


def test_a_file_gives_what_the_command_line_does_not(tmp_path):
    path = write(tmp_path, "model: tiny-dense\nport: 8123\nmax_waiting_requests: 7\nengine-in-process: true\n"
                           "speculative-config: {method: ngram, num_speculative_tokens: 2}\n")
    args = parse_arguments(["serve", "--config", path])
    assert (args.model, args.port, args.max_waiting_requests, args.engine_in_process) == ("tiny-dense", 8123, 7, True)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    flags = parse_arguments(["serve", "other", "--port", "9000", f"--config={path}"])
    assert (flags.model, flags.port, flags.max_waiting_requests) == ("other", 9000, 7)


def test_generate_from_a_file_prints_what_its_flags_print(tmp_path, capsys):
    path = write(tmp_path, "prompts: [Hello]\nmax-tokens: 6\ntemperature: 0\ndevice: cpu\nno_progress: true\n"
                           "stop: [xyz]\n")
    assert main(["generate", "--config", path]) == 0
    from_file = capsys.readouterr().out
    assert main(["generate", "Hello", "--max-tokens", "6", "--temperature", "0", "--device", "cpu", "--no-progress",
                 "--stop", "xyz"]) == 0
    assert capsys.readouterr().out == from_file


@pytest.mark.parametrize("text, message", [
    ("port: 8000\nno-such-option: 1\n", "'no-such-option' is not an option of this command"),
    ("port: eighty\n", "port"),
    ("engine-in-process: yes please\n", "is a switch: true or false"),
    ("port: [1, 2]\n", "takes one value"),
    ("- port\n- 8000\n", "expected a mapping"),
    ("port: 8000: 1\n", "not YAML"),
    ("device: tpu\n", "'tpu' is not one of"),
])
def test_a_bad_file_is_one_line_and_status_2(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    command = ["serve", "tiny-dense", "--config", path] if "device" not in text else ["generate", "hi", "--config", path]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith("metrale: error: --config") and message in err and err.count("\n") == 1


def test_a_missing_file_is_named(tmp_path, capsys):
    assert main(["serve", "tiny-dense", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err
