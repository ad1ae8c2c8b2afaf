"""run --chat: the question goes into the chat template the artifact's tokenizer carries."""

import json
import shutil

import pytest

from oscar_export.cli import main
from oscar_export.config import OscarConfig
from oscar_export.export.pipeline import export_artifact
from oscar_export.targets import get
from oscar_export.models import BUNDLED_MODEL_DIR

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"
QUESTION = "What say you, my lord?"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    work = tmp_path_factory.mktemp("chat")
    chat_model = work / "chat-model"
    shutil.copytree(BUNDLED_MODEL_DIR, chat_model)
    (chat_model / "chat_template.jinja").write_text(TEMPLATE)
    config = OscarConfig(k_bits=2, v_bits=2, sink=4, recent=8)
    for name, model in (("chat", str(chat_model)), ("plain", "bundled")):
        export_artifact(get("laptop"), model, work / name, "hadamard", 128, float_weights=True, config=config)
    return work


def _run(capsys, *argv):
    code = main(["run", "--max-new-tokens", "8", "--json", *argv])
    out = capsys.readouterr()
    return code, out


def test_chat_applies_the_artifacts_template(artifacts, capsys):
    for runtime in ("onnxruntime", "reference"):
        code, out = _run(capsys, "--artifact", str(artifacts / "chat"), "--chat", QUESTION, "--runtime", runtime)
        assert code == 0, out.err
        chat = json.loads(out.out)
        # The same as writing the templated text by hand (its <|bos|> is the template's, not added again).
        templated = f"<|bos|>user: {QUESTION}\nassistant:"
        code, out = _run(capsys, "--artifact", str(artifacts / "chat"), "--prompt", templated, "--runtime", runtime)
        by_hand = json.loads(out.out)
        assert chat == by_hand and len(chat["tokens"]) == 8, runtime


def test_chat_needs_a_template_and_excludes_prompt(artifacts, capsys):
    code, out = _run(capsys, "--artifact", str(artifacts / "plain"), "--chat", QUESTION)
    assert code == 2 and "no chat template" in out.err and len(out.err.strip().splitlines()) == 1, out.err
    with pytest.raises(SystemExit) as exit:
        main(["run", "--artifact", str(artifacts / "plain"), "--chat", QUESTION, "--prompt", "KING."])
    assert exit.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_artifact_files_are_readable_by_all(tmp_path):
    """Writers such as safetensors create 0600 files; an artifact's files must be readable by an app bundle or
    another user (as the umask allows), and executables stay executable."""
    import os

    from oscar_export.export.artifact import staged

    umask = os.umask(0o022)
    try:
        with staged(tmp_path / "art") as temp:
            (temp / "weights.bin").write_bytes(b"w")
            (temp / "weights.bin").chmod(0o600)
            (temp / "sub").mkdir(mode=0o700)
            (temp / "sub" / "lib.so").write_bytes(b"x")
            (temp / "sub" / "lib.so").chmod(0o700)
    finally:
        os.umask(umask)
    art = tmp_path / "art"
    assert (art / "weights.bin").stat().st_mode & 0o777 == 0o644
    assert (art / "sub").stat().st_mode & 0o777 == 0o755
    assert (art / "sub" / "lib.so").stat().st_mode & 0o777 == 0o755
