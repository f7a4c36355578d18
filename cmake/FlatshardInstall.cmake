# `cmake --install build [--prefix P]` (and DESTDIR=...): what a user or scripts/make_deb.sh gets.
#
#   bin/flatshardd, bin/flatshardctl                                    component daemon
#   lib/systemd/system/flatshard.service, lib/tmpfiles.d/flatshard.conf,
#   lib/sysusers.d/flatshard.conf, <sysconf>/flatshard/flatshardd.env,
#   share/man/man{1,8}/, share/doc/flatshard/                           component daemon
#   lib/libflatshard_client.so.<major>[.<minor>.<patch>]                component runtime
#   include/flatshard/{client,dtype,plan,version}.h, lib/libflatshard_client.{so,a},
#   lib/cmake/flatshard/, lib/pkgconfig/flatshard.pc                    component dev
#
# The unit, the env file and flatshard.pc name install-time paths, so they are written when
# installing (cmake/FlatshardInstallFiles.cmake) for the prefix actually used: <sysconf> is /etc
# for the prefix /usr (as GNUInstallDirs has it), <prefix>/etc otherwise.
include(CMakePackageConfigHelpers)

set(FS_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/flatshard CACHE STRING
    "Where flatshardConfig.cmake goes, relative to the prefix")

install(TARGETS flatshardd flatshardctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT daemon)

install(TARGETS flatshard_client_shared EXPORT flatshardTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
install(TARGETS flatshard_client_static EXPORT flatshardTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(FILES client/include/flatshard/client.h client/include/flatshard/dtype.h
              client/include/flatshard/plan.h
              ${PROJECT_BINARY_DIR}/generated/flatshard/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/flatshard COMPONENT dev)
install(EXPORT flatshardTargets NAMESPACE flatshard:: DESTINATION ${FS_CMAKE_INSTALL_DIR}
        COMPONENT dev)
configure_package_config_file(cmake/flatshardConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/flatshardConfig.cmake INSTALL_DESTINATION ${FS_CMAKE_INSTALL_DIR})
# 0.x: a new minor version may break the API, so 0.1 accepts 0.1.y only; from 1.0 on, the major.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(fs_compat SameMinorVersion)
else()
  set(fs_compat SameMajorVersion)
endif()
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/flatshardConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY ${fs_compat})
install(FILES ${PROJECT_BINARY_DIR}/cmake/flatshardConfig.cmake
              ${PROJECT_BINARY_DIR}/cmake/flatshardConfigVersion.cmake
        DESTINATION ${FS_CMAKE_INSTALL_DIR} COMPONENT dev)

install(FILES deploy/systemd/flatshard.tmpfiles DESTINATION lib/tmpfiles.d
        RENAME flatshard.conf COMPONENT daemon)
install(FILES deploy/systemd/flatshard.sysusers DESTINATION lib/sysusers.d
        RENAME flatshard.conf COMPONENT daemon)
install(FILES packaging/man/flatshardctl.1 DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 COMPONENT daemon)
install(FILES packaging/man/flatshardd.8 DESTINATION ${CMAKE_INSTALL_MANDIR}/man8 COMPONENT daemon)

# Written at install time for the prefix in use (see the top of this file).
foreach(what daemon dev)
  install(CODE "
    set(FS_WHAT ${what})
    set(FS_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\")
    set(FS_VERSION \"${PROJECT_VERSION}\")
    set(FS_BINDIR \"${CMAKE_INSTALL_BINDIR}\")
    set(FS_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
    set(FS_INCLUDEDIR \"${CMAKE_INSTALL_INCLUDEDIR}\")
    include(\"${PROJECT_SOURCE_DIR}/cmake/FlatshardInstallFiles.cmake\")
  " COMPONENT ${what})
endforeach()
