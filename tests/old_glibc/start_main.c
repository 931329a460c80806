/* SPDX-License-Identifier: MIT */
/* The program's one need past glibc 2.28: crt1.o's call into
 * __libc_start_main, which glibc 2.34 versioned anew. Linked with
 * -Wl,--wrap=__libc_start_main, the call lands here and goes to the
 * GLIBC_2.2.5 version that every glibc has. */
__asm__(".symver fkda_old_libc_start_main, __libc_start_main@GLIBC_2.2.5");
int fkda_old_libc_start_main(int (*main)(int, char**, char**), int argc, char** argv, void (*init)(void),
                             void (*fini)(void), void (*rtld_fini)(void), void* stack_end);

int __wrap___libc_start_main(int (*main)(int, char**, char**), int argc, char** argv, void (*init)(void),
                             void (*fini)(void), void (*rtld_fini)(void), void* stack_end) {
  return fkda_old_libc_start_main(main, argc, argv, init, fini, rtld_fini, stack_end);
}
