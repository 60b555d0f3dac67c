"""Write the Debian package's copyright file (machine-readable, DEP-5) from the metadata of what
the venv holds: one paragraph per distribution installed in it (its files, its copyright lines,
its license), the license texts that /usr/share/common-licenses lacks in full, and what a wheel
bundles inside its binaries (py-spy's SBOM of statically linked Rust crates; libyaml in PyYAML).

    python3 deploy/debian/copyright.py STAGE/usr/lib/gpuwatchd > STAGE/usr/share/doc/gpuwatchd/copyright

A distribution whose license this file does not know stops the build (exit 2, naming it): a new
dependency's license is then read and added here, never guessed. Standard library only.
"""

from __future__ import annotations

import csv
import email
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

DEST = "usr/lib/gpuwatchd"
# the license a distribution's metadata names (License-Expression, License, or its classifier) ->
# the DEP-5 short name; texts for those not in /usr/share/common-licenses come from the wheel
LICENSES = {
    "Apache-2.0": "Apache-2.0", "Apache Software License": "Apache-2.0",
    "MIT": "Expat", "MIT License": "Expat",
    "LGPL-2.1-or-later": "LGPL-2.1+",
    "BSD": "BSD-3-clause", "BSD License": "BSD-3-clause",
}
COMMON = {"Apache-2.0": "Apache-2.0", "LGPL-2.1+": "LGPL-2.1"}
# code inside a wheel's binaries that its metadata does not list (read from upstream's sources)
BUNDLED = {
    "PyYAML": "yaml/_yaml*.so links libyaml 0.2.5 statically (Expat; Copyright (c) 2017-2020 "
              "Ingy döt Net, (c) 2006-2016 Kirill Simonov).",
    "bcrypt": "_bcrypt.abi3.so is Rust code linking its crates statically (Apache-2.0 or Expat "
              "or BSD-3-clause, per crate: upstream's Cargo.lock).",
}


def _text(lines: list[str]) -> str:
    """Lines as a DEP-5 continuation: one space in front, '.' for an empty line."""
    return "\n".join(" " + ln.rstrip() if ln.strip() else " ." for ln in lines)


def _license(meta: email.message.Message) -> str:
    names = [meta.get("License-Expression"), meta.get("License")]
    names += [c.rsplit(" :: ", 1)[-1] for c in meta.get_all("Classifier", []) if c.startswith("License ::")]
    for name in names:
        if name and name.strip() in LICENSES:
            return LICENSES[name.strip()]
    sys.exit(f"deploy/debian/copyright.py: {meta['Name']}: no known license in {names}: add it to LICENSES")


def _spdx(component: dict[str, Any]) -> str:
    """A CycloneDX component's license: its SPDX expression, or its license ids."""
    return " ".join(x.get("expression") or x.get("license", {}).get("id", "?")
                    for x in component.get("licenses", [])) or "?"


def main(venv: Path) -> None:
    [site] = venv.glob("lib/python3*/site-packages")
    texts: dict[str, str] = {}
    paragraphs = []
    for dist in sorted(site.glob("*.dist-info"), key=lambda d: d.name.lower()):
        meta = email.message_from_string((dist / "METADATA").read_text(encoding="utf-8"))
        name, version = meta["Name"], meta["Version"]
        short = _license(meta)
        license_files = sorted(p for p in (dist / "licenses").rglob("*") if p.is_file()) \
            if (dist / "licenses").is_dir() else []
        # the files it installed, as DEP-5 patterns: each top-level directory, or the file itself
        files = set()
        for row in csv.reader(io.StringIO((dist / "RECORD").read_text(encoding="utf-8"))):
            path = (site / row[0]).resolve().relative_to(venv.resolve())
            top = path.parts[0] if path.parts[0] == "bin" else str(Path(*path.parts[:4]))
            files.add(f"{DEST}/{path}" if path.parts[0] == "bin" or (venv / top).is_file()
                      else f"{DEST}/{top}/*")
        # copyright lines: the license files', else the top of its modules (nvidia-ml-py)
        sources = license_files or sorted(site.glob(f"{(meta.get('Name') or '').replace('-', '_')}*.py"))
        if not sources:  # the largest module: its leading comment (pynvml.py's)
            sources = sorted((site / f"{t}.py" for t in (dist / "top_level.txt").read_text().split()),
                             key=lambda p: -p.stat().st_size)[:1]
        holders = []
        for src in sources:
            for line in src.read_text(encoding="utf-8", errors="replace").splitlines()[:60]:
                line = line.strip("# \t")
                if re.match(r"(?i)copyright\s+(\(c\)|©|\d{4})", line) and line not in holders \
                        and "Free Software Foundation" not in line:  # the LGPL's own text
                    holders.append(line)
        if not holders:  # Apache-2.0 and Expat texts here name no holder: the authors do
            author = meta.get("Author") or meta.get("Author-email") or f"the {name} authors"
            holders.append(f"{name} authors: {author}")
        if short not in COMMON and short not in texts:
            body: list[str] = []
            for src in sources[:1]:
                raw = src.read_text(encoding="utf-8", errors="replace").splitlines()
                if src.suffix == ".py":  # the license is the leading comment block
                    raw = [ln.strip("#").rstrip().removeprefix(" ") for ln in
                           raw[:next(i for i, ln in enumerate(raw[1:], 1) if not ln.startswith("#"))]]
                # the license's own terms, from their first sentence (no holder of this wheel)
                start = next((i for i, ln in enumerate(raw)
                              if re.match(r"\s*(Permission is hereby|Redistribution and use)", ln)), 0)
                body = raw[start:]
                while body and not body[-1].strip():
                    body.pop()
            texts[short] = _text(body).replace("\n .\n .", "\n .")
        para = [f"Files: {' '.join(sorted(files))}", f"Copyright: {holders[0]}"]
        para += [f" {h}" for h in holders[1:]]
        para.append(f"License: {short}")
        comments = [f"{name} {version}, installed from its wheel."]
        if name in BUNDLED:
            comments.append(BUNDLED[name])
        for sbom in sorted((dist / "sboms").glob("*.json")) if (dist / "sboms").is_dir() else []:
            crates = json.loads(sbom.read_text(encoding="utf-8")).get("components", [])
            listed = ", ".join(f"{c['name']} {c.get('version', '')} ({_spdx(c)})" for c in crates)
            comments.append(f"Statically linked into it ({sbom.name}, {len(crates)} crates): {listed}.")
        para.append("Comment: " + "\n ".join(comments))
        paragraphs.append("\n".join(para))
    out = ["Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/",
           "Upstream-Name: gpuwatchd",
           "Source: https://github.com/gpuwatchd/gpuwatchd",
           "Comment: The package holds a Python venv with gpuwatchd and the wheels of its",
           " dependencies; each has its paragraph below, made from its metadata at build time.",
           "",
           "Files: *",
           "Copyright: 2025-2026 gpuwatchd maintainers",
           "License: Apache-2.0",
           ""]
    out += [p + "\n" for p in paragraphs]
    used = {"Apache-2.0"} | {p.split("\nLicense: ")[1].split("\n")[0] for p in paragraphs}
    for short, common in COMMON.items():
        if short not in used:
            continue
        out.append(f"License: {short}\n On Debian systems, the full text of the license is in\n"
                   f" /usr/share/common-licenses/{common}.\n")
    for short, text in texts.items():
        out.append(f"License: {short}\n{text}\n")
    sys.stdout.write("\n".join(out).rstrip("\n") + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
