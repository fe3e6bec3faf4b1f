#!/usr/bin/env bash
# Print the absolute path of a working Python interpreter.
#   bash scripts/find_python.sh [NAME]      NAME: a command or path (default python3), e.g. python3.12
# A pythonX.Y that is not runnable from PATH (pyenv shims refuse versions not selected) is looked up
# under pyenv: $PYENV_ROOT/versions/X.Y.*/bin/pythonX.Y (newest patch first).
set -euo pipefail
want="${1:-python3}"
if exe="$("$want" -c 'import sys; print(sys.executable)' 2>/dev/null)" && [ -n "$exe" ]; then
  echo "$exe"
  exit 0
fi
if [[ "$(basename "$want")" =~ ^python([0-9]+\.[0-9]+)$ ]]; then
  v="${BASH_REMATCH[1]}"
  for cand in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V -r); do
    if "$cand" -c 'import sys' >/dev/null 2>&1; then
      echo "$cand"
      exit 0
    fi
  done
fi
echo "error: no working Python interpreter '$want' (not on PATH, not under pyenv)" >&2
exit 1
