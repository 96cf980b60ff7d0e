/*
 * allreduce_mpi: an MPI_Allreduce benchmark whose output mimics nccl-tests'
 * all_reduce_perf, used as the reference side of braid's side-by-side
 * comparison (see benches/README.md).
 *
 * Build: mpicc -O2 -Wall -Wextra -Werror -o allreduce_mpi allreduce_mpi.c
 * Run:   mpirun -np 4 ./allreduce_mpi -b 8 -e 64M -f 2 -n 20 -w 5 -j out.json
 *
 * For every size of the sweep b, b*f, b*f^2, ... <= e (bytes, rounded down to
 * a multiple of the element size) it times the out-of-place (separate send
 * and receive buffers) and the in-place (MPI_IN_PLACE) variant: `warmup`
 * untimed calls, a barrier, then `iters` timed calls. Each rank computes its
 * average time per call and the reported time is the maximum over ranks.
 *
 *   algbw = bytes / time            (GB/s, 1 GB = 1e9 bytes)
 *   busbw = algbw * 2 * (n - 1) / n (the nccl-tests all-reduce bus factor)
 *
 * Inputs are small integers (or powers of two for prod), so every reduction
 * order gives the same exact result; #wrong counts mismatching elements,
 * summed over ranks.
 */
#include <mpi.h>

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum dtype { DT_FLOAT, DT_DOUBLE, DT_INT32 };
enum redop { OP_SUM, OP_MAX, OP_MIN, OP_PROD };

/* Period of the input pattern along the element index. */
#define PATTERN_PERIOD 34 /* lcm(17, 2) */

struct options {
    unsigned long long min_bytes;
    unsigned long long max_bytes;
    unsigned long long factor;
    int iters;
    int warmup;
    enum dtype dtype;
    enum redop op;
    int check;
    const char *json_path;
};

struct measurement {
    double time_us;
    double algbw;
    double busbw;
    long long wrong; /* -1 when not checked */
};

struct row {
    unsigned long long size;
    unsigned long long count;
    struct measurement oop;
    struct measurement ip;
};

static int g_rank;
static int g_nranks;

static const char *dtype_name(enum dtype d)
{
    switch (d) {
    case DT_FLOAT: return "float";
    case DT_DOUBLE: return "double";
    case DT_INT32: return "int32";
    }
    return "?";
}

static size_t dtype_size(enum dtype d)
{
    switch (d) {
    case DT_FLOAT: return sizeof(float);
    case DT_DOUBLE: return sizeof(double);
    case DT_INT32: return sizeof(int32_t);
    }
    return 1;
}

static MPI_Datatype dtype_mpi(enum dtype d)
{
    switch (d) {
    case DT_FLOAT: return MPI_FLOAT;
    case DT_DOUBLE: return MPI_DOUBLE;
    case DT_INT32: return MPI_INT32_T;
    }
    return MPI_DATATYPE_NULL;
}

static const char *op_name(enum redop o)
{
    switch (o) {
    case OP_SUM: return "sum";
    case OP_MAX: return "max";
    case OP_MIN: return "min";
    case OP_PROD: return "prod";
    }
    return "?";
}

static MPI_Op op_mpi(enum redop o)
{
    switch (o) {
    case OP_SUM: return MPI_SUM;
    case OP_MAX: return MPI_MAX;
    case OP_MIN: return MPI_MIN;
    case OP_PROD: return MPI_PROD;
    }
    return MPI_OP_NULL;
}

static void usage(FILE *f, const char *prog)
{
    fprintf(f,
            "usage: %s [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-n ITERS] [-w WARMUP]\n"
            "          [-d float|double|int32] [-o sum|max|min|prod] [-c 0|1] [-j FILE]\n"
            "  -b  smallest size in bytes (suffix K, M or G for powers of 2; default 32M)\n"
            "  -e  largest size in bytes (default 32M)\n"
            "  -f  multiplication factor between sizes (integer >= 2; default 2)\n"
            "  -n  timed iterations per size and variant (default 20)\n"
            "  -w  warm-up iterations per size and variant (default 5)\n"
            "  -d  element type (default float)\n"
            "  -o  reduction (default sum)\n"
            "  -c  check results (default 1)\n"
            "  -j  write the results as JSON to FILE (rank 0)\n",
            prog);
}

/* Parses "123", "4K", "64M", "1G" (powers of 2). Returns 0 on success. */
static int parse_size(const char *s, unsigned long long *out)
{
    char *end = NULL;
    unsigned long long v;
    unsigned long long mult = 1;

    if (s == NULL || !isdigit((unsigned char)s[0]))
        return -1;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || end == s)
        return -1;
    if (*end != '\0') {
        switch (toupper((unsigned char)*end)) {
        case 'K': mult = 1ULL << 10; break;
        case 'M': mult = 1ULL << 20; break;
        case 'G': mult = 1ULL << 30; break;
        default: return -1;
        }
        end++;
        /* Accept an optional trailing "B" or "iB" (e.g. 64MiB, 1KB). */
        if (*end == 'i' || *end == 'I')
            end++;
        if (*end == 'B' || *end == 'b')
            end++;
        if (*end != '\0')
            return -1;
    }
    if (v != 0 && mult > UINT64_MAX / v)
        return -1;
    *out = v * mult;
    return 0;
}

static int parse_int(const char *s, int min, int *out)
{
    char *end = NULL;
    long v;

    errno = 0;
    v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < min || v > 1000000000L)
        return -1;
    *out = (int)v;
    return 0;
}

/* Returns 0 and fills opts, or 1 after printing the reason (rank 0). */
static int parse_args(int argc, char **argv, struct options *opts)
{
    int c;

    opts->min_bytes = 32ULL << 20;
    opts->max_bytes = 32ULL << 20;
    opts->factor = 2;
    opts->iters = 20;
    opts->warmup = 5;
    opts->dtype = DT_FLOAT;
    opts->op = OP_SUM;
    opts->check = 1;
    opts->json_path = NULL;

    opterr = 0;
    while ((c = getopt(argc, argv, "b:e:f:n:w:d:o:c:j:h")) != -1) {
        int bad = 0;
        switch (c) {
        case 'b': bad = parse_size(optarg, &opts->min_bytes); break;
        case 'e': bad = parse_size(optarg, &opts->max_bytes); break;
        case 'f':
            bad = parse_size(optarg, &opts->factor);
            if (!bad && opts->factor < 2)
                bad = 1;
            break;
        case 'n': bad = parse_int(optarg, 1, &opts->iters); break;
        case 'w': bad = parse_int(optarg, 0, &opts->warmup); break;
        case 'd':
            if (strcmp(optarg, "float") == 0 || strcmp(optarg, "f32") == 0)
                opts->dtype = DT_FLOAT;
            else if (strcmp(optarg, "double") == 0 || strcmp(optarg, "f64") == 0)
                opts->dtype = DT_DOUBLE;
            else if (strcmp(optarg, "int32") == 0 || strcmp(optarg, "int") == 0 ||
                     strcmp(optarg, "i32") == 0)
                opts->dtype = DT_INT32;
            else
                bad = 1;
            break;
        case 'o':
            if (strcmp(optarg, "sum") == 0)
                opts->op = OP_SUM;
            else if (strcmp(optarg, "max") == 0)
                opts->op = OP_MAX;
            else if (strcmp(optarg, "min") == 0)
                opts->op = OP_MIN;
            else if (strcmp(optarg, "prod") == 0)
                opts->op = OP_PROD;
            else
                bad = 1;
            break;
        case 'c':
            if (strcmp(optarg, "0") == 0)
                opts->check = 0;
            else if (strcmp(optarg, "1") == 0)
                opts->check = 1;
            else
                bad = 1;
            break;
        case 'j': opts->json_path = optarg; break;
        case 'h':
            if (g_rank == 0)
                usage(stdout, argv[0]);
            return 2;
        default:
            if (g_rank == 0) {
                fprintf(stderr, "allreduce_mpi: unknown option or missing value: -%c\n", optopt);
                usage(stderr, argv[0]);
            }
            return 1;
        }
        if (bad) {
            if (g_rank == 0)
                fprintf(stderr, "allreduce_mpi: bad value for -%c: '%s'\n", c, optarg);
            return 1;
        }
    }
    if (optind < argc) {
        if (g_rank == 0)
            fprintf(stderr, "allreduce_mpi: unexpected argument '%s'\n", argv[optind]);
        return 1;
    }
    if (opts->min_bytes > opts->max_bytes) {
        if (g_rank == 0)
            fprintf(stderr, "allreduce_mpi: -b (%llu) is larger than -e (%llu)\n",
                    opts->min_bytes, opts->max_bytes);
        return 1;
    }
    return 0;
}

/* Input of rank r at element i: exact whatever the reduction order. */
static double input_value(unsigned long long i, int r, enum redop op)
{
    if (op == OP_PROD)
        return 1.0 + (double)((i + (unsigned long long)r) % 2ULL);
    return (double)((i * 7ULL + (unsigned long long)r * 3ULL) % 17ULL);
}

/* Expected result at element i, for i in [0, PATTERN_PERIOD). */
static double expected_value(unsigned long long i, enum redop op)
{
    double acc = input_value(i, 0, op);
    int r;

    for (r = 1; r < g_nranks; r++) {
        double v = input_value(i, r, op);
        switch (op) {
        case OP_SUM: acc += v; break;
        case OP_MAX: acc = v > acc ? v : acc; break;
        case OP_MIN: acc = v < acc ? v : acc; break;
        case OP_PROD: acc *= v; break;
        }
    }
    return acc;
}

static void fill_input(void *buf, unsigned long long count, enum dtype d, enum redop op)
{
    double pattern[PATTERN_PERIOD];
    unsigned long long i;
    unsigned p = 0;

    for (i = 0; i < PATTERN_PERIOD; i++)
        pattern[i] = input_value(i, g_rank, op);

    switch (d) {
    case DT_FLOAT: {
        float *b = buf;
        for (i = 0; i < count; i++) {
            b[i] = (float)pattern[p];
            if (++p == PATTERN_PERIOD)
                p = 0;
        }
        break;
    }
    case DT_DOUBLE: {
        double *b = buf;
        for (i = 0; i < count; i++) {
            b[i] = pattern[p];
            if (++p == PATTERN_PERIOD)
                p = 0;
        }
        break;
    }
    case DT_INT32: {
        int32_t *b = buf;
        for (i = 0; i < count; i++) {
            b[i] = (int32_t)pattern[p];
            if (++p == PATTERN_PERIOD)
                p = 0;
        }
        break;
    }
    }
}

/* Mismatching elements on this rank. */
static long long count_wrong(const void *buf, unsigned long long count, enum dtype d,
                             enum redop op)
{
    double expect[PATTERN_PERIOD];
    unsigned long long i;
    unsigned p = 0;
    long long wrong = 0;

    for (i = 0; i < PATTERN_PERIOD; i++)
        expect[i] = expected_value(i, op);

    switch (d) {
    case DT_FLOAT: {
        const float *b = buf;
        for (i = 0; i < count; i++) {
            if (b[i] != (float)expect[p])
                wrong++;
            if (++p == PATTERN_PERIOD)
                p = 0;
        }
        break;
    }
    case DT_DOUBLE: {
        const double *b = buf;
        for (i = 0; i < count; i++) {
            if (b[i] != expect[p])
                wrong++;
            if (++p == PATTERN_PERIOD)
                p = 0;
        }
        break;
    }
    case DT_INT32: {
        const int32_t *b = buf;
        for (i = 0; i < count; i++) {
            if (b[i] != (int32_t)expect[p])
                wrong++;
            if (++p == PATTERN_PERIOD)
                p = 0;
        }
        break;
    }
    }
    return wrong;
}

/* MPI counts are int; a larger count is rejected up front. */
static double time_allreduce(const void *sendbuf, void *recvbuf, int count,
                             const struct options *o)
{
    MPI_Datatype dt = dtype_mpi(o->dtype);
    MPI_Op op = op_mpi(o->op);
    double t0, t1, avg, max_avg = 0.0;
    int it;

    for (it = 0; it < o->warmup; it++)
        MPI_Allreduce(sendbuf, recvbuf, count, dt, op, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    for (it = 0; it < o->iters; it++)
        MPI_Allreduce(sendbuf, recvbuf, count, dt, op, MPI_COMM_WORLD);
    t1 = MPI_Wtime();
    avg = (t1 - t0) / (double)o->iters;
    MPI_Allreduce(&avg, &max_avg, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return max_avg;
}

static void warm_up(const void *sendbuf, void *recvbuf, int count, int iters,
                    const struct options *o)
{
    int it;

    for (it = 0; it < iters; it++) {
        MPI_Allreduce(sendbuf, recvbuf, count, dtype_mpi(o->dtype), op_mpi(o->op),
                      MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, recvbuf, count, dtype_mpi(o->dtype), op_mpi(o->op),
                      MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

static long long check_result(const void *buf, unsigned long long count, const struct options *o)
{
    long long local = count_wrong(buf, count, o->dtype, o->op);
    long long total = 0;

    MPI_Allreduce(&local, &total, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    return total;
}

static void fill_measurement(struct measurement *m, double seconds, unsigned long long bytes)
{
    double factor = g_nranks > 1 ? 2.0 * (double)(g_nranks - 1) / (double)g_nranks : 0.0;

    m->time_us = seconds * 1e6;
    m->algbw = seconds > 0.0 ? (double)bytes / seconds / 1e9 : 0.0;
    m->busbw = m->algbw * factor;
}

static void run_size(unsigned long long bytes, void *sendbuf, void *recvbuf,
                     const struct options *o, struct row *row)
{
    size_t esize = dtype_size(o->dtype);
    unsigned long long count = bytes / esize;
    int n = (int)count;
    double secs;

    row->count = count;
    row->size = count * esize;

    /* Out of place. */
    fill_input(sendbuf, count, o->dtype, o->op);
    secs = time_allreduce(sendbuf, recvbuf, n, o);
    fill_measurement(&row->oop, secs, row->size);
    row->oop.wrong = -1;
    if (o->check) {
        /* Poison the output so a call that writes nothing is caught. */
        memset(recvbuf, 0xff, row->size);
        MPI_Allreduce(sendbuf, recvbuf, n, dtype_mpi(o->dtype), op_mpi(o->op), MPI_COMM_WORLD);
        row->oop.wrong = check_result(recvbuf, count, o);
    }

    /* In place: the timed calls reduce the buffer onto itself over and over,
     * as nccl-tests does; the check starts again from fresh inputs. */
    fill_input(recvbuf, count, o->dtype, o->op);
    secs = time_allreduce(MPI_IN_PLACE, recvbuf, n, o);
    fill_measurement(&row->ip, secs, row->size);
    row->ip.wrong = -1;
    if (o->check) {
        fill_input(recvbuf, count, o->dtype, o->op);
        MPI_Allreduce(MPI_IN_PLACE, recvbuf, n, dtype_mpi(o->dtype), op_mpi(o->op),
                      MPI_COMM_WORLD);
        row->ip.wrong = check_result(recvbuf, count, o);
    }
}

static void format_time(char *out, size_t len, double us)
{
    if (us >= 10000.0)
        snprintf(out, len, "%7.0f", us);
    else if (us >= 100.0)
        snprintf(out, len, "%7.1f", us);
    else
        snprintf(out, len, "%7.2f", us);
}

static void print_measurement(const struct measurement *m)
{
    char t[32];
    char w[32];

    format_time(t, sizeof t, m->time_us);
    if (m->wrong < 0)
        snprintf(w, sizeof w, "N/A");
    else
        snprintf(w, sizeof w, "%lld", m->wrong);
    printf("  %7s  %6.2f  %6.2f  %6s", t, m->algbw, m->busbw, w);
}

static void print_row(const struct row *r, const struct options *o)
{
    printf("%12llu  %12llu  %8s  %6s", r->size, r->count, dtype_name(o->dtype), op_name(o->op));
    print_measurement(&r->oop);
    print_measurement(&r->ip);
    printf("\n");
    fflush(stdout);
}

static void print_header(const struct options *o)
{
    char host[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    char *hosts = NULL;
    int *pids = NULL;
    int pid = (int)getpid();
    int r;

    MPI_Get_processor_name(host, &len);
    host[len < MPI_MAX_PROCESSOR_NAME ? len : MPI_MAX_PROCESSOR_NAME - 1] = '\0';
    if (g_rank == 0) {
        hosts = calloc((size_t)g_nranks, MPI_MAX_PROCESSOR_NAME);
        pids = calloc((size_t)g_nranks, sizeof(int));
        if (hosts == NULL || pids == NULL) {
            fprintf(stderr, "allreduce_mpi: out of memory\n");
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, 0,
               MPI_COMM_WORLD);
    MPI_Gather(&pid, 1, MPI_INT, pids, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (g_rank != 0)
        return;

    {
        char version[MPI_MAX_LIBRARY_VERSION_STRING];
        int vlen = 0;
        char *nl;
        MPI_Get_library_version(version, &vlen);
        version[vlen < MPI_MAX_LIBRARY_VERSION_STRING ? vlen : MPI_MAX_LIBRARY_VERSION_STRING - 1] =
            '\0';
        nl = strchr(version, ',');
        if (nl != NULL)
            *nl = '\0';
        printf("# %s MPI_Allreduce: nRanks %d minBytes %llu maxBytes %llu step: %llu(factor) "
               "warmup iters: %d iters: %d validation: %d\n",
               version, g_nranks, o->min_bytes, o->max_bytes, o->factor, o->warmup, o->iters,
               o->check);
    }
    printf("#\n# Using ranks\n");
    for (r = 0; r < g_nranks; r++)
        printf("#  Rank %2d Pid %6d on %10s\n", r, pids[r], hosts + (size_t)r * MPI_MAX_PROCESSOR_NAME);
    printf("#\n");
    /* Row prefix is 44 characters wide, each variant block 33. */
    printf("#%43s%23s%33s\n", "", "out-of-place", "in-place");
    printf("# %10s  %12s  %8s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count",
           "type", "redop", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
           "#wrong");
    printf("# %10s  %12s  %8s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)",
           "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    fflush(stdout);
    free(hosts);
    free(pids);
}

static void json_measurement(FILE *f, const struct measurement *m)
{
    fprintf(f, "{\"time_us\":%.6g,\"algbw\":%.6g,\"busbw\":%.6g,\"wrong\":", m->time_us, m->algbw,
            m->busbw);
    if (m->wrong < 0)
        fprintf(f, "null}");
    else
        fprintf(f, "%lld}", m->wrong);
}

static int write_json(const char *path, const struct row *rows, size_t nrows,
                      const struct options *o)
{
    FILE *f = fopen(path, "w");
    size_t i;

    if (f == NULL) {
        fprintf(stderr, "allreduce_mpi: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    fprintf(f, "{\"tool\":\"openmpi\",\"ranks\":%d,\"dtype\":\"%s\",\"op\":\"%s\",", g_nranks,
            dtype_name(o->dtype), op_name(o->op));
    fprintf(f, "\"iters\":%d,\"warmup\":%d,\"results\":[", o->iters, o->warmup);
    for (i = 0; i < nrows; i++) {
        fprintf(f, "%s\n  {\"size\":%llu,\"count\":%llu,\"oop\":", i ? "," : "", rows[i].size,
                rows[i].count);
        json_measurement(f, &rows[i].oop);
        fprintf(f, ",\"ip\":");
        json_measurement(f, &rows[i].ip);
        fprintf(f, "}");
    }
    fprintf(f, "\n]}\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "allreduce_mpi: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct options o;
    struct row *rows = NULL;
    size_t nrows = 0, cap = 0, i;
    unsigned long long size, max_alloc;
    void *sendbuf = NULL, *recvbuf = NULL;
    long long total_wrong = 0;
    double bw_sum = 0.0;
    int bw_n = 0;
    int rc;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_nranks);

    rc = parse_args(argc, argv, &o);
    if (rc != 0) {
        MPI_Finalize();
        return rc == 2 ? 0 : 2;
    }

    max_alloc = o.max_bytes / dtype_size(o.dtype) * dtype_size(o.dtype);
    if (max_alloc / dtype_size(o.dtype) > (unsigned long long)INT32_MAX) {
        if (g_rank == 0)
            fprintf(stderr, "allreduce_mpi: -e %llu exceeds the MPI int count limit\n",
                    o.max_bytes);
        MPI_Finalize();
        return 2;
    }
    /* At least one element so both pointers are valid for count 0. */
    sendbuf = malloc(max_alloc ? max_alloc : 8);
    recvbuf = malloc(max_alloc ? max_alloc : 8);
    if (sendbuf == NULL || recvbuf == NULL) {
        fprintf(stderr, "allreduce_mpi: rank %d: cannot allocate 2 x %llu bytes\n", g_rank,
                max_alloc);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* Touch every page before timing. */
    memset(sendbuf, 0, max_alloc);
    memset(recvbuf, 0, max_alloc);

    print_header(&o);

    /* Global warm-up, as nccl-tests does: at the largest and at the smallest
     * size, so the first timed size does not pay for connection set-up, first
     * touches and lazy symbol binding (MPI_Wtime included). The small calls
     * cost microseconds, so there are more of them: a handful is not enough
     * to settle the first latency figure. */
    (void)MPI_Wtime();
    fill_input(sendbuf, max_alloc / dtype_size(o.dtype), o.dtype, o.op);
    warm_up(sendbuf, recvbuf, (int)(max_alloc / dtype_size(o.dtype)), o.warmup, &o);
    warm_up(sendbuf, recvbuf, (int)(o.min_bytes / dtype_size(o.dtype)),
            o.warmup > 0 ? o.warmup + 200 : 0, &o);
    (void)MPI_Wtime();

    size = o.min_bytes;
    for (;;) {
        if (nrows == cap) {
            struct row *n;
            cap = cap ? cap * 2 : 32;
            n = realloc(rows, cap * sizeof *rows);
            if (n == NULL) {
                fprintf(stderr, "allreduce_mpi: out of memory\n");
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            rows = n;
        }
        run_size(size, sendbuf, recvbuf, &o, &rows[nrows]);
        if (g_rank == 0)
            print_row(&rows[nrows], &o);
        nrows++;
        if (size == 0 || size > o.max_bytes / o.factor)
            break;
        size *= o.factor;
    }

    for (i = 0; i < nrows; i++) {
        if (rows[i].oop.wrong > 0)
            total_wrong += rows[i].oop.wrong;
        if (rows[i].ip.wrong > 0)
            total_wrong += rows[i].ip.wrong;
        bw_sum += rows[i].oop.busbw + rows[i].ip.busbw;
        bw_n += 2;
    }

    rc = 0;
    if (g_rank == 0) {
        if (o.check)
            printf("# Out of bounds values : %lld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
        else
            printf("# Out of bounds values : N/A (check disabled)\n");
        printf("# Avg bus bandwidth    : %g \n#\n", bw_n ? bw_sum / bw_n : 0.0);
        fflush(stdout);
        if (o.json_path != NULL && write_json(o.json_path, rows, nrows, &o) != 0)
            rc = 1;
    }
    if (total_wrong > 0)
        rc = 1;

    free(rows);
    free(sendbuf);
    free(recvbuf);
    MPI_Finalize();
    return rc;
}
