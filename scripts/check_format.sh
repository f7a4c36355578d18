#!/usr/bin/env bash
# Checks that C++ files follow .clang-format (Google-based). With no argument: the files that
# differ from origin/main (or, where that is HEAD itself as in a fresh clone, from HEAD~1 and
# every uncommitted change); `--all`: every tracked C++ file. Prints each misformatted file
# with the command that fixes it, and exits 1 if there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
if ! command -v "$CLANG_FORMAT" >/dev/null; then
  echo "check_format: $CLANG_FORMAT not found (apt-get install clang-format)" >&2
  exit 2
fi
pattern='\.(h|cc|cpp|hpp)$'
if [ "${1:-}" = "--all" ]; then
  mapfile -t files < <(git ls-files | grep -E "$pattern" || true)
else
  base=$(git merge-base HEAD origin/main 2>/dev/null || true)
  if [ -z "$base" ] || [ "$base" = "$(git rev-parse HEAD)" ]; then
    base=$(git rev-parse --verify -q HEAD~1 || git rev-parse HEAD)
  fi
  mapfile -t files < <({ git diff --name-only --diff-filter=ACMR "$base"; git diff --name-only --diff-filter=ACMR; } \
                       | sort -u | grep -E "$pattern" || true)
fi
bad=0
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  if ! "$CLANG_FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "check_format: $f is not formatted: $CLANG_FORMAT -i $f"
    bad=1
  fi
done
echo "check_format: ${#files[@]} file(s) checked"
exit $bad
