"""Tables measured in terminal columns: a note made of wide characters or blanks other than
the space cannot overflow its line, be wrapped by the terminal, and pass for a row of its own
(``untrusted.cells``, ``untrusted.wrap_cells``, ``cli.format.table_with_notes``)."""

from __future__ import annotations

from pollux_local.cli.format import NOTE_INDENT, table, table_with_notes
from pollux_local.untrusted import cells, printable, wrap_cells


def test_columns_a_text_takes() -> None:
    assert cells("abc") == 3
    assert cells("漢字") == 4  # wide: two columns each
    assert cells("e\u0301") == 1  # a combining accent takes none
    assert cells("ｆｕｌｌ") == 8  # full-width forms


def test_blanks_other_than_the_space_are_escaped_on_one_line() -> None:
    line = printable("a\u3000b\u00a0c\u2007d", newline=False)
    assert line == "a\\u3000b\\xa0c\\u2007d"
    assert printable("a\u3000b") == "a\u3000b"  # text shown as text (show, logs) keeps them


def test_a_table_aligns_wide_cells_by_columns() -> None:
    lines = table([["漢字漢字", "x"], ["ab", "y"]]).splitlines()
    assert [cells(line[: line.index(last)]) for line, last in zip(lines, "xy", strict=True)] == [
        10,
        10,
    ]


def test_a_note_of_wide_characters_stays_under_its_row() -> None:
    """The spoof of a review: blanks and wide characters that ``len`` counts short, then
    text shaped like another user's row, in a job's failure note."""
    spoof = "exited (" + "漢" * 30 + " " + "\u3000" * 40 + "12  gpu-train  s54b  running  1"
    rows = [["ID", "NAME", "NOTE"], ["14", "data-prep", spoof], ["12", "gpu-train", ""]]
    out = table_with_notes(rows, 60).splitlines()
    assert all(cells(line) <= 60 for line in out), out
    starts = [line.split()[0] for line in out if not line.startswith(NOTE_INDENT)]
    assert starts == ["ID", "14", "12"], out  # one row per job, no row made by the note
    assert "\\u3000" in "".join(out)


def test_wrapping_by_columns_cuts_a_word_wider_than_a_line() -> None:
    lines = wrap_cells("ab " + "漢" * 25, 20, "  ")
    assert all(cells(line) <= 20 and line.startswith("  ") for line in lines)
    assert "".join(line.strip() for line in lines[1:]) == "漢" * 25
