/* SPDX-License-Identifier: MIT */
/* Prints what fkda_get_build_info of the library named on the command line
 * reports. The library is opened by path, so that no other copy on the
 * loader's search path can answer in its place. */
#include <dlfcn.h>
#include <stdio.h>

#include <flashkda.h>

typedef fkda_status (*get_build_info_fn)(fkda_build_info*);

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIBRARY\n", argv[0]);
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  get_build_info_fn get_build_info;
  /* POSIX's way from a data pointer to a function pointer. */
  *(void**)&get_build_info = dlsym(library, "fkda_get_build_info");
  fkda_build_info info = FKDA_BUILD_INFO_INIT;
  if (get_build_info == NULL || get_build_info(&info) != FKDA_SUCCESS) {
    fprintf(stderr, "fkda_get_build_info failed in %s\n", argv[1]);
    return 1;
  }
  printf("cuda_version=%d\nmin_driver_version=%d\narchitectures=%s\n", (int)info.cuda_version,
         (int)info.min_driver_version, info.architectures);
  return 0;
}
