/* closedloop: a closed-loop HTTP/1.1 load generator light enough not to take the cores it
 * measures.
 *
 * CONNECTIONS kept-alive connections, each sending its next request as soon as the last one
 * is answered (one at a time, no pipelining), the requests taken in turn from REQUESTS (a
 * file of records: a 4-byte little-endian length, then that many bytes). First WARMUP rounds
 * on every connection, untimed; then it prints "warm" and waits for a line on stdin (the
 * caller reads the server's CPU meanwhile); then the timed part: every connection goes on
 * until COUNT requests in all are answered, each timed from its write to the end of its
 * answer (read by its Content-Length). The count is the connections' together, not a share
 * each: a connection to a faster server (one replica of several, on a core less busy) sends
 * more of them, as it would in a window of time, and none waits idle for the slowest to
 * finish a quota. At the COUNT-th answer it prints "counted" (the caller reads the server's
 * CPU again); the answers still owed after it are read, untimed. At the end it
 * prints a JSON summary (requests answered 200 in the timed part, the others, its seconds
 * and the CPU this process spent in it) and writes each 200's latency (int64 ns, in the
 * order answered) to OUT. A connection the server closes ends the run with status 1.
 *
 *     cc -O2 -o closedloop closedloop.c
 *     closedloop HOST PORT CONNECTIONS WARMUP COUNT REQUESTS OUT
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clocks.h"
#include "request_file.h"

#define BUFFER 65536

typedef struct {
    int fd;
    int64_t sent;    /* requests sent on this connection so far */
    int64_t sent_at; /* ns, monotonic */
    size_t filled;   /* bytes in buffer */
    char buffer[BUFFER];
} Connection;

static Connection *connections;
static int connection_count, epoll;
static char **requests;
static uint32_t *lengths;
static int request_count;
static int64_t *latencies, timed, failed;
static int64_t to_send, outstanding, counted, end_ns; /* this round's */
static double end_cpu;
static int timing;

static void fail(const char *what) {
    fprintf(stderr, "closedloop: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void send_next(Connection *c) {
    int i = c->sent++ % request_count;
    size_t done = 0;
    c->sent_at = now_ns();
    while (done < lengths[i]) { /* a request fits the empty socket buffer: no EAGAIN here */
        ssize_t n = write(c->fd, requests[i] + done, lengths[i] - done);
        if (n < 0 && errno != EINTR) fail("write");
        if (n > 0) done += n;
    }
}

/* The length of the whole answer at the head of `c`'s buffer, 0 while incomplete. */
static size_t answer_length(Connection *c) {
    char *end = memmem(c->buffer, c->filled, "\r\n\r\n", 4);
    if (end == NULL) return 0;
    size_t head = end + 4 - c->buffer;
    for (char *line = c->buffer; line < end; line++) {
        if ((line == c->buffer || line[-1] == '\n') && strncasecmp(line, "content-length:", 15) == 0) {
            size_t total = head + strtoul(line + 15, NULL, 10);
            return c->filled >= total ? total : 0;
        }
    }
    fprintf(stderr, "closedloop: an answer without Content-Length\n");
    exit(1);
}

static void readable(Connection *c) {
    for (;;) {
        ssize_t n = read(c->fd, c->buffer + c->filled, BUFFER - c->filled);
        if (n == 0) {
            fprintf(stderr, "closedloop: the server closed a connection\n");
            exit(1);
        }
        if (n < 0) {
            if (errno == EAGAIN) return;
            if (errno == EINTR) continue;
            fail("read");
        }
        c->filled += n;
        size_t length = answer_length(c);
        if (length == 0) {
            if (c->filled == BUFFER) {
                fprintf(stderr, "closedloop: an answer longer than %d bytes\n", BUFFER);
                exit(1);
            }
            continue;
        }
        int64_t latency = now_ns() - c->sent_at;
        int status = atoi(c->buffer + 9); /* "HTTP/1.1 200 ..." */
        memmove(c->buffer, c->buffer + length, c->filled - length);
        c->filled -= length;
        if (timing && counted > 0) {
            if (status == 200) latencies[timed++] = latency;
            else failed++;
            if (--counted == 0) {
                end_ns = now_ns();
                end_cpu = cpu_seconds();
                printf("counted\n"); /* the caller reads the server's CPU again */
                fflush(stdout);
            }
        }
        outstanding--;
        if (to_send > 0) {
            to_send--;
            outstanding++;
            send_next(c);
        }
        return; /* one request at a time: nothing more comes until the next is sent */
    }
}

/* `total` requests (at least one per connection), each connection sending its next when the
 * last is answered; the first `total` answers are counted; returns when all are answered. */
static void round_of(int64_t total) {
    struct epoll_event events[256];
    to_send = total - connection_count;
    counted = total;
    outstanding = connection_count;
    for (int i = 0; i < connection_count; i++) send_next(&connections[i]);
    while (outstanding > 0) {
        int n = epoll_wait(epoll, events, 256, -1);
        if (n < 0 && errno != EINTR) fail("epoll_wait");
        for (int i = 0; i < n; i++) readable(&connections[events[i].data.u32]);
    }
}

static void open_connections(const char *host, int port) {
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &address.sin_addr) != 1) {
        fprintf(stderr, "closedloop: not an IPv4 address: %s\n", host);
        exit(1);
    }
    epoll = epoll_create1(0);
    connections = calloc(connection_count, sizeof *connections);
    for (int i = 0; i < connection_count; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (fd < 0) fail("socket");
        if (connect(fd, (struct sockaddr *)&address, sizeof address) < 0) fail("connect");
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (fcntl(fd, F_SETFL, O_NONBLOCK) < 0) fail("fcntl");
        connections[i].fd = fd;
        struct epoll_event e = {.events = EPOLLIN, .data.u32 = i};
        if (epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &e) < 0) fail("epoll_ctl");
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: closedloop HOST PORT CONNECTIONS WARMUP COUNT REQUESTS OUT\n");
        return 2;
    }
    connection_count = atoi(argv[3]);
    int64_t warmup = atoll(argv[4]), count = atoll(argv[5]);
    if (connection_count < 1 || warmup < 0 || count < connection_count) {
        fprintf(stderr, "closedloop: need CONNECTIONS >= 1, WARMUP >= 0, COUNT >= CONNECTIONS\n");
        return 2;
    }
    RequestFile file = read_requests("closedloop", argv[6]);
    requests = file.data;
    lengths = file.lengths;
    request_count = file.count;
    latencies = malloc(count * sizeof *latencies);
    open_connections(argv[1], atoi(argv[2]));
    if (warmup > 0) round_of(warmup * connection_count);
    printf("warm\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) return 1; /* the caller went away */
    timing = 1;
    double cpu = cpu_seconds();
    int64_t start = now_ns();
    round_of(count);
    double seconds = (end_ns - start) / 1e9;
    cpu = end_cpu - cpu;
    FILE *out = fopen(argv[7], "wb");
    if (out == NULL || fwrite(latencies, sizeof *latencies, timed, out) != (size_t)timed) fail(argv[7]);
    fclose(out);
    printf("{\"answered\": %lld, \"failed\": %lld, \"seconds\": %.6f, \"cpu_seconds\": %.6f}\n",
           (long long)timed, (long long)failed, seconds, cpu);
    return 0;
}
