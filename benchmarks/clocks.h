/* The load clients' clocks (openloop.c, closedloop.c): monotonic nanoseconds and this
 * process's CPU seconds. */
#ifndef LOCKGATE_BENCH_CLOCKS_H
#define LOCKGATE_BENCH_CLOCKS_H

#include <stdint.h>
#include <sys/resource.h>
#include <time.h>

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline double cpu_seconds(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
           u.ru_stime.tv_usec / 1e6;
}

#endif
