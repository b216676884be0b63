"""Tables measured in terminal columns: a note made of wide characters or blanks other than
the space cannot overflow its line, be wrapped by the terminal, and pass for a row of its own
(``untrusted.cells``, ``untrusted.wrap_cells``, ``cli.format.table_with_notes``)."""

from __future__ import annotations

from pollux_local.cli.format import NOTE_INDENT, SHOW_INDENT, fit_line, table, table_with_notes
from pollux_local.untrusted import cells, cells_at_most, printable, wrap_cells


def test_columns_a_text_takes() -> None:
    assert cells("abc") == 3
    assert cells("漢字") == 4  # wide: two columns each
    assert cells("e\u0301") == 1  # a combining accent takes none
    assert cells("ｆｕｌｌ") == 8  # full-width forms
    assert cells("\u302e") == 2  # a spacing mark, wide: drawn in two columns (glibc's wcwidth)
    # at most: never below 1 a character, and 2 for the ambiguous ones (wide in East Asian
    # terminals)
    assert cells_at_most("e\u0301") == 3 and cells_at_most("\u302e") == 2  # U+0301: "A"
    assert cells_at_most("\u00e9") == 2 and cells("\u00e9") == 1
    assert cells_at_most("abc") == 3


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


def test_a_note_of_spacing_marks_stays_under_its_row() -> None:
    """Review s55: U+302E, a spacing combining mark drawn in two columns, was counted as
    none; 34 of them and a fake row made ``status`` show a row for a job that did not exist."""
    spoof = "replica exited with code 1 (" + "\u302e" * 34 + "12  gpu-train  s55b  running  1"
    rows = [["ID", "NAME", "NOTE"], ["2", "data-prep", spoof], ["3", "gpu-train", ""]]
    for width in (60, 80, 100, 120):
        out = table_with_notes(rows, width).splitlines()
        assert all(cells_at_most(line) <= width for line in out), (width, out)
        starts = [line.split()[0] for line in out if not line.startswith(NOTE_INDENT)]
        assert starts == ["ID", "2", "3"], (width, out)


def test_wrapping_by_columns_cuts_a_word_wider_than_a_line() -> None:
    lines = wrap_cells("ab " + "漢" * 25, 20, "  ")
    assert all(cells(line) <= 20 and line.startswith("  ") for line in lines)
    assert "".join(line.strip() for line in lines[1:]) == "漢" * 25


def test_a_show_line_too_wide_goes_on_behind_the_labels() -> None:
    """``show`` wraps a line wider than the terminal itself: what follows never starts at
    column 0 (where the terminal's own wrap put it), so it cannot pass for another field."""
    reason = "x " * 40 + "\u302e" * 30 + "  owner       root"
    lines = fit_line(f"  state       failed  — {reason}", 60)
    assert lines[0].startswith("  state       failed")
    assert len(lines) > 1 and all(line.startswith(SHOW_INDENT) for line in lines[1:])
    assert all(cells_at_most(line) <= 60 for line in lines)
    assert fit_line("  state       running", 60) == ["  state       running"]
    assert fit_line("x" * 200, None) == ["x" * 200]  # piped: no width, as it is
