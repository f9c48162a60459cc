/* openloop: an open-loop HTTP/1.1 load generator light enough not to be the limit.
 *
 * Poisson arrivals at RATE per second for SECONDS, each a pre-encoded request taken in turn
 * from REQUESTS (a file of records: a 4-byte little-endian length, then that many bytes).
 * Requests go out on at most CONNECTIONS kept-alive connections, one request at a time on
 * each (no pipelining), opened as they are needed; a request that comes due while every
 * connection is busy waits for one, and that wait counts in its latency. Latency counts from
 * the scheduled time. Answers are read by their Content-Length; a connection the server
 * closes is replaced, and a request it carried unanswered gets status 0. Whatever is still
 * unanswered DRAIN seconds after the last arrival gets status -1.
 *
 * Writes one record per request to OUT (int64 latency_ns, int64 lag_ns, int32 status,
 * int32 padding; lag: how late this client dispatched the request, its own delay) and prints
 * a JSON summary: the rate it dispatched at and the CPU it used over the arrival window.
 *
 *     cc -O2 -o openloop openloop.c -lm
 *     openloop HOST PORT RATE SECONDS CONNECTIONS SEED DRAIN REQUESTS OUT
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "clocks.h"
#include "request_file.h"

#define BUFFER 65536

typedef struct {
    int64_t latency_ns, lag_ns;
    int32_t status, pad;
} Record;

typedef struct {
    int fd, open, busy, writing;
    int64_t current;  /* request index, -1 if none */
    size_t written;   /* bytes of the current request written */
    size_t filled;    /* bytes in buffer */
    char buffer[BUFFER];
} Connection;

static struct sockaddr_in address;
static int epoll, max_connections, open_count;
static Connection *connections;
static int *idle, idle_count;
static int64_t *queue, queue_head, queue_tail; /* requests waiting for a connection */
static int64_t *scheduled;                     /* ns, monotonic */
static Record *records;
static int64_t answered;
static char **requests;
static uint32_t *lengths;
static int request_count;

static double runqueue_seconds(void) { /* time spent runnable but waiting for a core */
    unsigned long long running = 0, waiting = 0;
    FILE *f = fopen("/proc/self/schedstat", "r");
    if (f) {
        if (fscanf(f, "%llu %llu", &running, &waiting) != 2) waiting = 0;
        fclose(f);
    }
    return waiting / 1e9;
}

static uint64_t rng_state;
static double uniform(void) { /* splitmix64, in [0, 1) */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

static void finish(int64_t request, int status) {
    records[request].status = status;
    records[request].latency_ns = now_ns() - scheduled[request];
    answered++;
}

static void watch(Connection *c, int out) {
    struct epoll_event e = {.events = EPOLLIN | (out ? EPOLLOUT : 0), .data.u32 = c - connections};
    epoll_ctl(epoll, EPOLL_CTL_MOD, c->fd, &e);
}

static void write_more(Connection *c) {
    const char *data = requests[c->current % request_count];
    size_t length = lengths[c->current % request_count];
    while (c->written < length) {
        ssize_t n = write(c->fd, data + c->written, length - c->written);
        if (n < 0) {
            if (errno == EAGAIN) break;
            return; /* the read side sees the close */
        }
        c->written += n;
    }
    int pending = c->written < length;
    if (pending != c->writing) watch(c, pending);
    c->writing = pending;
}

static void send_on(Connection *c, int64_t request) {
    c->busy = 1;
    c->current = request;
    c->written = 0;
    write_more(c);
}

static void connect_one(void) {
    int slot = -1;
    for (int i = 0; i < max_connections; i++)
        if (!connections[i].open) {
            slot = i;
            break;
        }
    if (slot < 0) return;
    Connection *c = &connections[slot];
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    connect(c->fd, (struct sockaddr *)&address, sizeof address);
    c->open = 1, c->busy = 1, c->writing = 1, c->current = -1, c->filled = 0;
    open_count++;
    struct epoll_event e = {.events = EPOLLIN | EPOLLOUT, .data.u32 = slot};
    epoll_ctl(epoll, EPOLL_CTL_ADD, c->fd, &e);
}

static void next_on(Connection *c) {
    c->busy = 0;
    c->current = -1;
    if (queue_head < queue_tail)
        send_on(c, queue[queue_head++]);
    else
        idle[idle_count++] = c - connections;
}

static void submit(int64_t request) {
    while (idle_count) {
        Connection *c = &connections[idle[--idle_count]];
        if (c->open && !c->busy) {
            send_on(c, request);
            return;
        }
    }
    queue[queue_tail++] = request;
    if (open_count < max_connections) connect_one();
}

static void close_connection(Connection *c) {
    epoll_ctl(epoll, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    for (int i = 0; i < idle_count; i++)
        if (idle[i] == c - connections) idle[i] = idle[--idle_count];
    c->open = 0;
    open_count--;
    if (c->current >= 0) finish(c->current, 0);
    c->current = -1;
    if (queue_head < queue_tail && open_count < max_connections) connect_one();
}

static int64_t header_value(const char *head, size_t length, const char *name) {
    size_t n = strlen(name);
    for (size_t i = 0; i + n < length; i++)
        if (strncasecmp(head + i, name, n) == 0) return strtoll(head + i + n, NULL, 10);
    return -1;
}

static int has_close(const char *head, size_t length) {
    const char *needle = "connection: close";
    size_t n = strlen(needle);
    for (size_t i = 0; i + n <= length; i++)
        if (strncasecmp(head + i, needle, n) == 0) return 1;
    return 0;
}

static void readable(Connection *c) {
    for (;;) {
        ssize_t n = read(c->fd, c->buffer + c->filled, BUFFER - c->filled);
        if (n == 0 || (n < 0 && errno != EAGAIN)) {
            close_connection(c);
            return;
        }
        if (n < 0) return;
        c->filled += n;
        for (;;) {
            char *end = memmem(c->buffer, c->filled, "\r\n\r\n", 4);
            if (end == NULL || c->current < 0) break;
            size_t head = end - c->buffer;
            int64_t body = header_value(c->buffer, head, "content-length:");
            if (body < 0) body = 0;
            size_t total = head + 4 + body;
            if (total > BUFFER) { /* an answer larger than the buffer: count it failed */
                close_connection(c);
                return;
            }
            if (c->filled < total) break;
            int status = atoi(c->buffer + 9);
            int closing = has_close(c->buffer, head);
            memmove(c->buffer, c->buffer + total, c->filled - total);
            c->filled -= total;
            finish(c->current, status);
            c->current = -1;
            if (closing) {
                close_connection(c);
                return;
            }
            next_on(c);
        }
    }
}

static void writable(Connection *c) {
    if (c->current < 0 && c->busy) { /* a connect finished */
        int error = 0;
        socklen_t size = sizeof error;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &error, &size);
        if (error) { /* refused: fail one waiting request, as raw_load does */
            if (queue_head < queue_tail) finish(queue[queue_head++], 0);
            close_connection(c);
            return;
        }
        c->writing = 0;
        watch(c, 0);
        next_on(c);
        return;
    }
    if (c->current >= 0) write_more(c);
}

int main(int argc, char **argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s HOST PORT RATE SECONDS CONNECTIONS SEED DRAIN REQUESTS OUT\n",
                argv[0]);
        return 2;
    }
    address.sin_family = AF_INET;
    address.sin_port = htons(atoi(argv[2]));
    inet_pton(AF_INET, argv[1], &address.sin_addr);
    double rate = atof(argv[3]), seconds = atof(argv[4]), drain = atof(argv[7]);
    max_connections = atoi(argv[5]);
    rng_state = strtoull(argv[6], NULL, 10);
    RequestFile file = read_requests("openloop", argv[8]);
    requests = file.data;
    lengths = file.lengths;
    request_count = file.count;
    prctl(PR_SET_TIMERSLACK, 1);

    /* the schedule: Poisson offsets in [0, seconds) */
    int64_t count = 0, capacity = (int64_t)(rate * seconds * 1.2) + 1024;
    double *offsets = malloc(capacity * sizeof *offsets);
    for (double t = -log(1 - uniform()) / rate; t < seconds; t += -log(1 - uniform()) / rate) {
        if (count == capacity) offsets = realloc(offsets, (capacity *= 2) * sizeof *offsets);
        offsets[count++] = t;
    }
    scheduled = malloc((count + 1) * sizeof *scheduled);
    records = calloc(count + 1, sizeof *records);
    queue = malloc((count + 1) * sizeof *queue);
    connections = calloc(max_connections, sizeof *connections);
    idle = malloc(max_connections * sizeof *idle);
    for (int64_t i = 0; i < count; i++) records[i].status = -1;

    epoll = epoll_create1(0);
    int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event te = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    epoll_ctl(epoll, EPOLL_CTL_ADD, timer, &te);

    int64_t start = now_ns() + 20000000; /* 20 ms to arm */
    for (int64_t i = 0; i < count; i++) scheduled[i] = start + (int64_t)(offsets[i] * 1e9);
    int64_t next = 0, stop = start + (int64_t)(seconds * 1e9);
    int64_t drain_end = stop + (int64_t)(drain * 1e9);
    double cpu_start = cpu_seconds(), cpu_window = 0;
    double wait_start = runqueue_seconds(), wait_window = 0;
    int64_t window_end = 0;
    struct epoll_event events[256];
    while (answered < count) {
        int64_t now = now_ns();
        while (next < count && scheduled[next] <= now) { /* every arrival due by now */
            records[next].lag_ns = now - scheduled[next];
            submit(next++);
        }
        if (next == count && !window_end) {
            window_end = now;
            cpu_window = cpu_seconds() - cpu_start;
            wait_window = runqueue_seconds() - wait_start;
        }
        if (next == count && now > drain_end) break;
        int64_t wake = next < count ? scheduled[next] : drain_end;
        struct itimerspec at = {.it_value = {wake / 1000000000, wake % 1000000000}};
        timerfd_settime(timer, TFD_TIMER_ABSTIME, &at, NULL);
        int n = epoll_wait(epoll, events, 256, -1);
        for (int i = 0; i < n; i++) {
            if (events[i].data.u32 == UINT32_MAX) {
                uint64_t expirations;
                ssize_t ignored = read(timer, &expirations, sizeof expirations);
                (void)ignored;
                continue;
            }
            Connection *c = &connections[events[i].data.u32];
            if (!c->open) continue;
            if (events[i].events & EPOLLOUT) writable(c);
            if (c->open && (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP))) readable(c);
        }
    }
    if (!window_end) {
        window_end = now_ns();
        cpu_window = cpu_seconds() - cpu_start;
        wait_window = runqueue_seconds() - wait_start;
    }
    int64_t late = 0;
    for (int64_t i = 0; i < count; i++)
        if (records[i].status == -1) records[i].latency_ns = now_ns() - scheduled[i], late++;

    FILE *out = fopen(argv[9], "wb");
    if (!out || fwrite(records, sizeof *records, count, out) != (size_t)count) {
        perror(argv[9]);
        return 2;
    }
    fclose(out);
    double window = (window_end - start) / 1e9;
    printf("{\"sent\": %ld, \"window_s\": %.6f, \"dispatch_rate\": %.1f, \"cpu_s\": %.4f, "
           "\"cpu_share\": %.4f, \"runqueue_share\": %.4f, \"connections\": %d, "
           "\"unanswered\": %ld}\n",
           (long)count, window, count / window, cpu_window, cpu_window / window,
           wait_window / window, open_count, (long)late);
    return 0;
}
