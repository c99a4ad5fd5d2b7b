"""The README's layout section is the tree: every folder of the package has its entry (or is named in its parent's),
and every module is named in its folder's entry; every entry names a folder that exists."""
import re

from tests.conftest import ROOT


def layout_entries(readme: str) -> dict:
    """{folder path: the text of its entry} from the code block after the "Layout" paragraph. An entry starts at a
    line whose first word ends in "/" (two leading spaces: a sub-folder of the entry above it)."""
    block = readme[readme.index("Layout —"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    entries, parent, current = {}, "", None
    for line in block.splitlines():
        match = re.match(r"^( {0,2})(\S+/)\s", line + " ")
        if match and not line.startswith("   "):
            folder = match.group(2).rstrip("/")
            if match.group(1):
                folder = f"{parent}/{folder}"
            else:
                parent = folder
            current = folder
            entries[current] = ""
        if current is not None:
            entries[current] += " " + line
    return entries


def package_folders() -> list:
    package = ROOT / "portable_fsdp"
    return sorted(p for p in [package, *package.rglob("*")] if p.is_dir() and any(p.glob("*.py")))


def _entry_for(folder, entries: dict):
    """The entry that describes `folder`: its own, else its parent's (which names it)."""
    relative = folder.relative_to(ROOT).as_posix()
    if relative in entries:
        return relative, entries[relative]
    parent = folder.parent.relative_to(ROOT).as_posix()
    assert f"{folder.name}/" in entries.get(parent, ""), f"README layout: no entry for {relative}/"
    return parent, entries[parent]


def test_every_folder_and_module_is_in_the_layout():
    entries = layout_entries((ROOT / "README.md").read_text())
    for folder in package_folders():
        where, text = _entry_for(folder, entries)
        for module in sorted(folder.glob("*.py")):
            if module.name == "__init__.py":
                continue
            named = module.name if where == folder.relative_to(ROOT).as_posix() else module.stem
            assert re.search(rf"(?<![\w.]){re.escape(named)}(?!\w)", text), \
                f"README layout: {module.relative_to(ROOT)} is not named in the {where}/ entry"


def test_every_entry_is_a_folder():
    for folder in layout_entries((ROOT / "README.md").read_text()):
        assert (ROOT / folder).is_dir(), f"README layout names {folder}/, which does not exist"


def test_the_check_can_fail():
    readme = "Layout —\n```\nportable_fsdp/    a.py\n  sub/            b.py\n```\n"
    assert layout_entries(readme) == {"portable_fsdp": " portable_fsdp/    a.py", "portable_fsdp/sub": "   sub/            b.py"}
