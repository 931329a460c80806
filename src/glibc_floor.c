/* SPDX-License-Identifier: MIT */
/*
 * The glibc floor of libflashkda.so: nothing newer than GLIBC_2.28 may be
 * needed, so that one build loads on every distribution with glibc 2.28 or
 * later (RHEL 8, Debian 10, Ubuntu 20.04 and everything since).
 *
 * Built against a newer glibc, the library would bind to the versions that
 * glibc 2.34 introduced when it folded libdl and libpthread into libc. Each
 * function below shadows such an entry point for every object linked into the
 * library (ours and the static libstdc++ alike; the version script keeps the
 * shadows local) and forwards to the GLIBC_2.2.5 version of the same function,
 * which glibc 2.28 provides from libdl.so.2 and libpthread.so.0 and newer
 * glibc keeps in libc.so.6. tests/unit/test_abi.cpp fails, naming the symbol,
 * when anything newer slips in.
 */
#include <dlfcn.h>
#include <pthread.h>

#define FKDA_GLIBC_2_2_5(name) __asm__(".symver fkda_glibc_" #name ", " #name "@GLIBC_2.2.5")

FKDA_GLIBC_2_2_5(dlopen);
FKDA_GLIBC_2_2_5(dlsym);
FKDA_GLIBC_2_2_5(dlerror);
FKDA_GLIBC_2_2_5(dlclose);
FKDA_GLIBC_2_2_5(pthread_create);
FKDA_GLIBC_2_2_5(pthread_join);
FKDA_GLIBC_2_2_5(pthread_detach);
FKDA_GLIBC_2_2_5(pthread_once);
FKDA_GLIBC_2_2_5(__pthread_key_create);

void* fkda_glibc_dlopen(const char* file, int mode);
void* fkda_glibc_dlsym(void* handle, const char* name);
char* fkda_glibc_dlerror(void);
int fkda_glibc_dlclose(void* handle);
int fkda_glibc_pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*), void* arg);
int fkda_glibc_pthread_join(pthread_t thread, void** result);
int fkda_glibc_pthread_detach(pthread_t thread);
int fkda_glibc_pthread_once(pthread_once_t* once, void (*init)(void));
int fkda_glibc___pthread_key_create(pthread_key_t* key, void (*destructor)(void*));
int __pthread_key_create(pthread_key_t* key, void (*destructor)(void*));

void* dlopen(const char* file, int mode) { return fkda_glibc_dlopen(file, mode); }
void* dlsym(void* handle, const char* name) { return fkda_glibc_dlsym(handle, name); }
char* dlerror(void) { return fkda_glibc_dlerror(); }
int dlclose(void* handle) { return fkda_glibc_dlclose(handle); }
int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*), void* arg) {
  return fkda_glibc_pthread_create(thread, attr, start, arg);
}
int pthread_join(pthread_t thread, void** result) { return fkda_glibc_pthread_join(thread, result); }
int pthread_detach(pthread_t thread) { return fkda_glibc_pthread_detach(thread); }
int pthread_once(pthread_once_t* once, void (*init)(void)) { return fkda_glibc_pthread_once(once, init); }
int __pthread_key_create(pthread_key_t* key, void (*destructor)(void*)) {
  return fkda_glibc___pthread_key_create(key, destructor);
}

/* libstdc++'s headers (and its static archive) read this glibc 2.32 flag to
 * skip atomic reference counting in single-threaded processes. A private
 * copy that always says "threads may exist" keeps every count atomic, which
 * is correct in any process and needs nothing from glibc. */
char __libc_single_threaded = 0;
