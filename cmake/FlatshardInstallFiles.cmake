# Runs inside `cmake --install` (see cmake/FlatshardInstall.cmake), once per component, with
# FS_WHAT (daemon or dev) and the build's relative install dirs set. Writes the files that name
# install-time paths, for CMAKE_INSTALL_PREFIX as given to `cmake --install --prefix`, under
# $DESTDIR when set (scripts/make_deb.sh: DESTDIR=stage, prefix /usr).
set(fs_prefix "${CMAKE_INSTALL_PREFIX}")
if(fs_prefix STREQUAL "/usr")
  set(fs_sysconf "/etc")   # as GNUInstallDirs: /usr's configuration lives in /etc
else()
  set(fs_sysconf "${fs_prefix}/etc")
endif()

# Writes CONTENT to PATH (absolute, without DESTDIR) and records it in install_manifest.txt.
# A function, not a macro: a macro would expand the ${...} that CONTENT holds.
function(fs_install_text path content)
  set(fs_file "$ENV{DESTDIR}${path}")
  message(STATUS "Installing: ${fs_file}")
  file(WRITE "${fs_file}" "${content}")
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${fs_file}")
  set(CMAKE_INSTALL_MANIFEST_FILES "${CMAKE_INSTALL_MANIFEST_FILES}" PARENT_SCOPE)
endfunction()

# Replaces FROM with TO in the variable VAR; fails if FROM is not there (the source drifted).
macro(fs_replace var from to what)
  string(FIND "${${var}}" "${from}" fs_at)
  if(fs_at EQUAL -1)
    message(FATAL_ERROR "flatshard install: ${what} has no '${from}' to point at the prefix")
  endif()
  string(REPLACE "${from}" "${to}" ${var} "${${var}}")
endmacro()

if(FS_WHAT STREQUAL "daemon")
  # The systemd unit, installed as flatshard.service, with this prefix's paths.
  file(READ "${FS_SOURCE_DIR}/deploy/systemd/flatshardd.service" fs_unit)
  fs_replace(fs_unit "ExecStart=/usr/local/bin/flatshardd "
             "ExecStart=${fs_prefix}/${FS_BINDIR}/flatshardd " "deploy/systemd/flatshardd.service")
  fs_replace(fs_unit "EnvironmentFile=-/etc/flatshard/flatshardd.env"
             "EnvironmentFile=-${fs_sysconf}/flatshard/flatshardd.env"
             "deploy/systemd/flatshardd.service")
  fs_install_text("${fs_prefix}/lib/systemd/system/flatshard.service" "${fs_unit}")

  # The daemon's flags. An existing (possibly edited) file is kept.
  set(fs_env "${fs_sysconf}/flatshard/flatshardd.env")
  if(EXISTS "$ENV{DESTDIR}${fs_env}")
    message(STATUS "Keeping: $ENV{DESTDIR}${fs_env} (exists; the shipped one is "
                   "${FS_SOURCE_DIR}/deploy/systemd/flatshardd.env)")
  else()
    file(READ "${FS_SOURCE_DIR}/deploy/systemd/flatshardd.env" fs_env_text)
    fs_install_text("${fs_env}" "${fs_env_text}")
  endif()
elseif(FS_WHAT STREQUAL "dev")
  # pkg-config: the shared library by default; `pkg-config --static` adds what the static
  # archive needs (link it with -l:libflatshard_client.a).
  # No CUDA library: libcudart is opened at run time (dlopen, in libc since glibc 2.34).
  set(fs_private_libs "-pthread")
  fs_install_text("${fs_prefix}/${FS_LIBDIR}/pkgconfig/flatshard.pc" "\
prefix=${fs_prefix}
libdir=\${prefix}/${FS_LIBDIR}
includedir=\${prefix}/${FS_INCLUDEDIR}

Name: flatshard
Description: flatshard client library: a trainer's view of flatshardd's FSDP flat-parameter shards
Version: ${FS_VERSION}
Requires: absl_status absl_statusor absl_strings absl_time
Requires.private: grpc++ protobuf libcrypto absl_flat_hash_map absl_synchronization absl_str_format
Libs: -L\${libdir} -lflatshard_client
Libs.private: ${fs_private_libs}
Cflags: -I\${includedir}
")
else()
  message(FATAL_ERROR "FlatshardInstallFiles.cmake: FS_WHAT is '${FS_WHAT}', not daemon or dev")
endif()
