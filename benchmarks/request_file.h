/* The load clients' requests (openloop.c, closedloop.c), read from the file
 * `write_requests` (benchmarks/serving_maxrate.py) writes: each request's length (uint32,
 * little-endian) and then its bytes. */
#ifndef LOCKGATE_BENCH_REQUEST_FILE_H
#define LOCKGATE_BENCH_REQUEST_FILE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    char **data;
    uint32_t *lengths;
    int count;
} RequestFile;

/* The requests in `path`; a file that cannot be read, is cut short or holds none ends the
 * program `program` with status 2. */
static RequestFile read_requests(const char *program, const char *path) {
    RequestFile file = {NULL, NULL, 0};
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        perror(path);
        exit(2);
    }
    uint32_t length;
    while (fread(&length, 4, 1, f) == 1) {
        file.data = realloc(file.data, (file.count + 1) * sizeof *file.data);
        file.lengths = realloc(file.lengths, (file.count + 1) * sizeof *file.lengths);
        file.data[file.count] = malloc(length);
        if (fread(file.data[file.count], 1, length, f) != length) {
            fprintf(stderr, "%s: a short request file: %s\n", program, path);
            exit(2);
        }
        file.lengths[file.count++] = length;
    }
    fclose(f);
    if (file.count == 0) {
        fprintf(stderr, "%s: no requests in %s\n", program, path);
        exit(2);
    }
    return file;
}

#endif
