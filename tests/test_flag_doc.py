"""docs/estimator.md's flag table is the parser's (estimator.flag_doc): every flag, no stale one."""
from __future__ import annotations

from estimator import cli, flag_doc


def test_the_docs_flag_table_is_generated_from_the_parser():
    doc = flag_doc.DOC.read_text()
    assert flag_doc.with_table(doc, flag_doc.flag_table()) == doc, "run: python -m estimator.flag_doc"
    assert flag_doc.main(["--check"]) == 0


def test_every_flag_has_a_row_and_a_new_flag_would_show_as_out_of_date():
    parser = cli.build_parser()
    table = flag_doc.flag_table(parser)
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}`" in table
    parser.add_argument("--a-new-flag", help="something the doc does not have yet")
    assert flag_doc.with_table(flag_doc.DOC.read_text(), flag_doc.flag_table(parser)) != flag_doc.DOC.read_text()
