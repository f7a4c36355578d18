#!/usr/bin/env bash
# Builds flatshard's Debian 12 packages from a build tree with dpkg-deb (no debian/ source tree,
# no rebuild): `cmake --install` into a staging root (DESTDIR, prefix /usr), then each installed
# file goes to exactly one package by its path:
#
#   flatshard               /usr/bin/flatshard{d,ctl}, /etc/flatshard/flatshardd.env (conffile),
#                           /lib/systemd/system/flatshard.service, /usr/lib/{tmpfiles,sysusers}.d/,
#                           man pages; postinst adds the flatshard user and group, creates the
#                           directories and enables and starts the service (when systemd runs)
#   libflatshard-client<N>  /usr/lib/libflatshard_client.so.<N>[.*] (shlibs, ldconfig trigger)
#   libflatshard-dev        headers, libflatshard_client.{so,a}, CMake package, flatshard.pc
#   python3-flatshard       /usr/lib/python3*/ (only when the build installs a Python package)
#
#   <pkg>-dbgsym            the debug symbols of <pkg>'s ELF files, by build-id
#                           (/usr/lib/debug/.build-id/xx/yyyy.debug; .gnu_debuglink in the file)
#
# A file no rule claims fails the build, naming it. Binaries and libraries are stripped (their
# symbols split off into the -dbgsym packages), man pages compressed, each package gets
# copyright and changelog.Debian.gz, Depends comes from dpkg-shlibdeps (complete: CUDA and NCCL
# are loaded at run time, not linked), timestamps from the last commit (SOURCE_DATE_EPOCH).
# The maintainer scripts are packaging/debian/<pkg>.{postinst,prerm,postrm}.
#
#   scripts/make_deb.sh [--build-dir DIR] [--out-dir DIR] [--revision N]
#
# --build-dir defaults to ${FS_BUILD_DIR:-build} (it must be built: `bash scripts/build.sh`);
# --out-dir to DIR/deb. Prints the path of each .deb, one a line. DEBFULLNAME and DEBEMAIL name
# the maintainer.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${FS_BUILD_DIR:-build}
OUT_DIR=""
REVISION=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --build-dir=*) BUILD_DIR=${1#*=}; shift ;;
    --out-dir) OUT_DIR=$2; shift 2 ;;
    --out-dir=*) OUT_DIR=${1#*=}; shift ;;
    --revision) REVISION=$2; shift 2 ;;
    --revision=*) REVISION=${1#*=}; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "make_deb: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$PWD/$BUILD_DIR" ;; esac
[ -n "$OUT_DIR" ] || OUT_DIR="$BUILD_DIR/deb"
case "$OUT_DIR" in /*) ;; *) OUT_DIR="$PWD/$OUT_DIR" ;; esac

die() { echo "make_deb: $*" >&2; exit 1; }
for tool in dpkg-deb dpkg-shlibdeps dpkg-architecture strip objcopy readelf gzip cmake; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install dpkg-dev binutils cmake)"
done
[ -f "$BUILD_DIR/CMakeCache.txt" ] || die "$BUILD_DIR is not a configured build (bash scripts/build.sh)"
for f in server/flatshardd client/flatshardctl; do
  [ -x "$BUILD_DIR/$f" ] || die "$BUILD_DIR/$f is not built (bash scripts/build.sh)"
done

VERSION=$(sed -n 's/^project(flatshard VERSION \([0-9.]*\).*/\1/p' "$ROOT/CMakeLists.txt")
[ -n "$VERSION" ] || die "no version in CMakeLists.txt's project()"
SOVERSION=${VERSION%%.*}
DEBVERSION="$VERSION-$REVISION"
ARCH=$(dpkg --print-architecture)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || date +%s)}
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/flatshard-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STAGE="$WORK/stage"

# 1. Everything `cmake --install` installs, for /usr.
DESTDIR="$STAGE" cmake --install "$BUILD_DIR" --prefix /usr > "$WORK/install.log" \
  || die "cmake --install failed: $(tail -5 "$WORK/install.log")"
# Debian 12 keeps systemd units in /lib/systemd/system (lintian: systemd-service-file-outside-lib).
if [ -d "$STAGE/usr/lib/systemd/system" ]; then
  mkdir -p "$STAGE/lib/systemd"
  mv "$STAGE/usr/lib/systemd/system" "$STAGE/lib/systemd/"
  rmdir "$STAGE/usr/lib/systemd"
fi

# 2. Each file to its package.
package_of() {
  case "$1" in
    usr/bin/flatshardd|usr/bin/flatshardctl|etc/flatshard/*|lib/systemd/system/flatshard.service|\
    usr/lib/tmpfiles.d/flatshard.conf|usr/lib/sysusers.d/flatshard.conf|usr/share/man/*)
      echo flatshard ;;
    usr/lib/libflatshard_client.so.*|usr/lib/*/libflatshard_client.so.*) echo "libflatshard-client$SOVERSION" ;;
    usr/include/flatshard/*|usr/lib/libflatshard_client.so|usr/lib/libflatshard_client.a|\
    usr/lib/*/libflatshard_client.so|usr/lib/*/libflatshard_client.a|usr/lib/cmake/flatshard/*|\
    usr/lib/*/cmake/flatshard/*|usr/lib/pkgconfig/flatshard.pc|usr/lib/*/pkgconfig/flatshard.pc)
      echo libflatshard-dev ;;
    usr/lib/python3/*|usr/lib/python3.*/*) echo python3-flatshard ;;
    *) return 1 ;;
  esac
}
PACKAGES=()
DBGSYM=()
unclaimed=()
while IFS= read -r rel; do
  pkg=$(package_of "$rel") || { unclaimed+=("/$rel"); continue; }
  mkdir -p "$WORK/pkg/$pkg/$(dirname "$rel")"
  mv "$STAGE/$rel" "$WORK/pkg/$pkg/$rel"
done < <(cd "$STAGE" && find . \( -type f -o -type l \) | sed 's|^\./||' | LC_ALL=C sort)
[ ${#unclaimed[@]} -eq 0 ] || die "no package claims ${unclaimed[*]} (add a rule to package_of)"
for pkg in flatshard "libflatshard-client$SOVERSION" libflatshard-dev python3-flatshard; do
  [ -d "$WORK/pkg/$pkg" ] && PACKAGES+=("$pkg")
done
for pkg in flatshard "libflatshard-client$SOVERSION" libflatshard-dev; do
  [ -d "$WORK/pkg/$pkg" ] || die "the install produced nothing for $pkg"
done

# 3. Strip, compress man pages, add docs.
CHANGELOG_DATE=$(date -u -R -d "@$SOURCE_DATE_EPOCH")
# Debian's usual variables name the maintainer (Maintainer: and the changelog's trailer).
MAINTAINER="${DEBFULLNAME:-flatshard maintainers} <${DEBEMAIL:-flatshard-maintainers@example.org}>"
# Debug symbols go to <pkg>-dbgsym as Debian's dh_strip puts them: the part objcopy
# --only-keep-debug keeps (the symbol table, and DWARF when the build has -g) in
# /usr/lib/debug/.build-id/<xx>/<rest of the build-id>.debug, and a .gnu_debuglink to it in the
# stripped file; gdb and debuginfod find them by build-id.
split_debug() {  # split_debug PKG FILE STRIP_ARGS...: strips FILE, its symbols to PKG-dbgsym
  local pkg=$1 f=$2; shift 2
  local id
  id=$(readelf -n "$f" | awk '/Build ID:/ {print $3; exit}')
  if [ -z "$id" ]; then strip "$@" "$f"; return; fi
  local dbg="$WORK/pkg/$pkg-dbgsym/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug"
  mkdir -p "$(dirname "$dbg")"
  objcopy --only-keep-debug --compress-debug-sections "$f" "$dbg"
  strip "$@" "$f"
  objcopy --add-gnu-debuglink="$dbg" "$f"
  echo "$id" >> "$WORK/build-ids.$pkg"
}
for pkg in "${PACKAGES[@]}"; do
  P="$WORK/pkg/$pkg"
  while IFS= read -r f; do
    case "$(head -c 4 "$f" | od -An -c | tr -d ' ')" in
      177ELF)
        case "$f" in
          *.so|*.so.*) split_debug "$pkg" "$f" --remove-section=.comment --remove-section=.note --strip-unneeded ;;
          *) split_debug "$pkg" "$f" --remove-section=.comment --remove-section=.note ;;
        esac ;;
      '!<ar') strip --strip-debug --remove-section=.comment --enable-deterministic-archives "$f" ;;
    esac
  done < <(find "$P" -type f)
  if [ -d "$P/usr/share/man" ]; then
    find "$P/usr/share/man" -type f ! -name '*.gz' -exec gzip -9n {} +
  fi
  doc="$P/usr/share/doc/$pkg"
  mkdir -p "$doc"
  install -m 0644 "$ROOT/packaging/debian/copyright" "$doc/copyright"
  printf '%s (%s) unstable; urgency=medium\n\n  * Built from git %s by scripts/make_deb.sh.\n\n -- %s  %s\n' \
    "flatshard" "$DEBVERSION" "$COMMIT" "$MAINTAINER" "$CHANGELOG_DATE" | gzip -9n > "$doc/changelog.Debian.gz"
done
gzip -9nc "$ROOT/README.md" > "$WORK/pkg/flatshard/usr/share/doc/flatshard/README.md.gz"
for pkg in "${PACKAGES[@]}"; do
  [ -d "$WORK/pkg/$pkg-dbgsym" ] || continue
  doc="$WORK/pkg/$pkg-dbgsym/usr/share/doc"
  mkdir -p "$doc"
  ln -s "$pkg" "$doc/$pkg-dbgsym"  # Debian's dbgsym packages share their package's docs
  DBGSYM+=("$pkg-dbgsym")
done

# 4. Depends: dpkg-shlibdeps over each package's ELF files, our own library known locally.
mkdir -p "$WORK/src/debian"
printf 'Source: flatshard\n\nPackage: flatshard\nArchitecture: any\n' > "$WORK/src/debian/control"
LIBDIR_REL=$(cd "$WORK/pkg/libflatshard-client$SOVERSION" && dirname "$(find . -name "libflatshard_client.so.$SOVERSION" | head -1)")
printf 'libflatshard_client %s libflatshard-client%s (>= %s)\n' "$SOVERSION" "$SOVERSION" "$VERSION" \
  > "$WORK/src/debian/shlibs.local"
shlibs_of() {
  local pkg=$1 elfs=()
  while IFS= read -r f; do
    [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = 177ELF ] || continue
    case "$f" in *.a) continue ;; esac
    elfs+=("$f")
  done < <(find "$WORK/pkg/$pkg" -type f)
  [ ${#elfs[@]} -gt 0 ] || return 0
  # Every library we link comes from a Debian package (CUDA and NCCL are opened at run time,
  # never linked), so Depends is complete: a library without dependency information fails.
  local out
  out=$(cd "$WORK/src" && dpkg-shlibdeps -O \
          -l"$WORK/pkg/libflatshard-client$SOVERSION/$LIBDIR_REL" "${elfs[@]}" 2> "$WORK/shlibdeps.log") \
    || die "dpkg-shlibdeps on $pkg failed: $(cat "$WORK/shlibdeps.log")"
  sed -n 's/^shlibs:Depends=//p' <<< "$out"
}

# 5. Control files and the .debs.
mkdir -p "$OUT_DIR"
stanza() {  # the control.in stanza of package $1, placeholders filled
  sed "s/@SOVERSION@/$SOVERSION/g; s/@ARCH@/$ARCH/g; s/@DEBVERSION@/$DEBVERSION/g" \
    "$ROOT/packaging/debian/control.in" \
    | awk -v want="$1" 'BEGIN{RS=""; ORS="\n"} /^#/{sub(/^(#[^\n]*\n)+/, "")} $0 ~ "^Package: " want "\n" {print}'
}
dbgsym_stanza() {  # the stanza of $1 (<pkg>-dbgsym), as debhelper writes it
  local of=${1%-dbgsym}
  printf 'Package: %s\nAuto-Built-Package: debug-symbols\nArchitecture: %s\n' "$1" "$ARCH"
  printf 'Depends: %s (= %s)\nSection: debug\nPriority: optional\n' "$of" "$DEBVERSION"
  printf 'Description: debug symbols for %s\n' "$of"
  printf 'Build-Ids: %s\n' "$(LC_ALL=C sort "$WORK/build-ids.$of" | tr '\n' ' ' | sed 's/ $//')"
}
for pkg in "${PACKAGES[@]}" "${DBGSYM[@]}"; do
  P="$WORK/pkg/$pkg"
  mkdir -p "$P/DEBIAN"
  if [ "${pkg%-dbgsym}" != "$pkg" ]; then
    st=$(dbgsym_stanza "$pkg")
  else
    shlibs=$(shlibs_of "$pkg")
    st=$(stanza "$pkg")
    [ -n "$st" ] || die "packaging/debian/control.in has no stanza for $pkg"
    if [ -n "$shlibs" ]; then st=${st//@SHLIBS@/$shlibs}; else st=$(sed 's/, @SHLIBS@//; /^Depends: @SHLIBS@$/d' <<< "$st"); fi
  fi
  case "$st" in *@*@*) die "control.in: unfilled placeholder in $pkg: $(grep -o '@[A-Z]*@' <<< "$st" | head -1)" ;; esac
  size=$(du -sk --exclude=DEBIAN "$P" | cut -f1)
  {
    sed -n '1p' <<< "$st"
    echo "Source: flatshard"
    echo "Version: $DEBVERSION"
    echo "Maintainer: $MAINTAINER"
    echo "Installed-Size: $size"
    sed '1d' <<< "$st"
  } > "$P/DEBIAN/control"
  for script in postinst prerm postrm; do
    if [ -f "$ROOT/packaging/debian/$pkg.$script" ]; then
      install -m 0755 "$ROOT/packaging/debian/$pkg.$script" "$P/DEBIAN/$script"
    fi
  done
  if [ "$pkg" = flatshard ]; then
    (cd "$P" && find etc -type f | sed 's|^|/|' | LC_ALL=C sort) > "$P/DEBIAN/conffiles"
  fi
  if [ "$pkg" = "libflatshard-client$SOVERSION" ]; then
    cp "$WORK/src/debian/shlibs.local" "$P/DEBIAN/shlibs"
    echo "activate-noawait ldconfig" > "$P/DEBIAN/triggers"
    chmod 0644 "$P/DEBIAN/shlibs" "$P/DEBIAN/triggers"
  fi
  (cd "$P" && find . -path ./DEBIAN -prune -o -type f -print | sed 's|^\./||' | LC_ALL=C sort \
     | xargs -r -d '\n' md5sum) > "$P/DEBIAN/md5sums"
  # Owners root:root (--root-owner-group); modes normalized whatever the umask.
  find "$P" -type d -exec chmod 0755 {} +
  find "$P" -type f ! -path "$P/DEBIAN/*" -exec chmod 0644 {} +
  [ -d "$P/usr/bin" ] && chmod 0755 "$P"/usr/bin/*
  chmod 0644 "$P/DEBIAN/control" "$P/DEBIAN/md5sums" "$P"/DEBIAN/conffiles 2>/dev/null || true
  find "$P" -newermt "@$SOURCE_DATE_EPOCH" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
  deb="$OUT_DIR/${pkg}_${DEBVERSION}_${ARCH}.deb"
  dpkg-deb --root-owner-group -Zxz --build "$P" "$deb" > /dev/null
  echo "$deb"
done
