"""The README's examples cannot rot: its Python block runs here, and its C++
block is an excerpt of examples/cpp/quickstart.cpp, which the test command
builds against an installed kvindex (the CTest test install.consumer)."""
import contextlib
import io
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def readme_blocks(language):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.findall(r"```%s\n(.*?)```" % language, text, re.S)


def test_the_python_example_runs_and_finds_the_needle():
    blocks = readme_blocks("python")
    assert len(blocks) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), {})
    # the query points at token 1234: the sparse index finds it, and its
    # attention stays close to exact
    m = re.fullmatch(r"relative error ([0-9.e+-]+), top id (\d+)\n", out.getvalue())
    assert m, out.getvalue()
    assert int(m.group(2)) == 1234
    assert float(m.group(1)) < 0.05


def test_the_cpp_excerpt_is_in_the_built_example():
    blocks = readme_blocks("cpp")
    assert len(blocks) == 1
    with open(os.path.join(ROOT, "examples", "cpp", "quickstart.cpp")) as f:
        source = f.read()
    excerpt = blocks[0].rstrip("\n")
    assert excerpt in source, "README.md's C++ block is not a verbatim excerpt of examples/cpp/quickstart.cpp"
