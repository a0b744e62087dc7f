#!/usr/bin/env bash
# Print the path of a working Python 3.12 interpreter, or explain what is missing and fail.
set -u
try() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$1"; exit 0; }; }
[ -n "${PYTHON:-}" ] && try "$PYTHON"
command -v python3.12 >/dev/null 2>&1 && try "$(command -v python3.12)"
if command -v pyenv >/dev/null 2>&1; then
  for p in "$(pyenv root)"/versions/3.12*/bin/python3.12; do [ -x "$p" ] && try "$p"; done
fi
for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
  [ -x "$p" ] && try "$p"
done
echo "error: jaxmoe needs Python 3.12 (none found: not python3.12 on PATH, not in pyenv)." >&2
echo "       Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
exit 1
