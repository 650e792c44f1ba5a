# Sourced by the launchers: sets PYTHON to the interpreter that has the project installed.
# Order: $PYTHON as given, the active virtualenv, the .venv next to the repository (what
# `make install` creates), then python3/python on PATH. The choice is checked (torch and
# orthros_train importable) so a wrong one fails here with the fix, not inside torchrun.
find_python() {
  local repo candidate
  # Under Slurm this script runs from a spool copy: the repository is where sbatch was called.
  for repo in "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "${SLURM_SUBMIT_DIR:-}"; do
    [[ -n $repo && -d $repo/orthros_train ]] && break
  done
  if [[ -n ${PYTHON:-} ]]; then
    candidate=$PYTHON
  elif [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
    candidate=$VIRTUAL_ENV/bin/python
  elif [[ -x $repo/.venv/bin/python ]]; then
    candidate=$repo/.venv/bin/python
  else
    candidate=$(command -v python3 || command -v python || true)
  fi
  if [[ -z $candidate ]] || ! "$candidate" -c \
    "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') and u.find_spec('orthros_train') else 1)" \
    2>/dev/null; then
    echo "$0: no Python with torch and orthros_train found (tried: ${candidate:-none}); run \`make install\`" \
      "in the repository (it creates .venv) or set PYTHON=/path/to/python" >&2
    exit 2
  fi
  PYTHON=$candidate
}
find_python
