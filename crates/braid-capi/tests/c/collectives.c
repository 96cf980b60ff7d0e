/* Every collective of braid.h against exact expected values: all dtypes and ops for all-reduce, out of
 * place and in place, unaligned buffers, count 0 with NULL buffers, every root for broadcast and reduce,
 * and the asynchronous variants. Run as every rank of `braid run -n N`. */
#include <sched.h>
#include <stdint.h>

#include "check.h"

static int g_world;
static long g_checks;

/* Rank r's input element i for op: small values so every result is exact in every dtype. */
static double input(int r, size_t i, braid_dtype t, braid_redop op) {
  if (op == BRAID_PROD) return 1 + (double)((r + i) % 2);
  double v = (double)((r * 3 + i) % 11);
  if (is_signed(t) && op != BRAID_AVG) v -= 5;
  return v;
}

static double expected(size_t i, braid_dtype t, braid_redop op) {
  double acc = input(0, i, t, op);
  for (int r = 1; r < g_world; r++) {
    double x = input(r, i, t, op);
    switch (op) {
      case BRAID_SUM: case BRAID_AVG: acc += x; break;
      case BRAID_PROD: acc *= x; break;
      case BRAID_MAX: acc = x > acc ? x : acc; break;
      case BRAID_MIN: acc = x < acc ? x : acc; break;
    }
  }
  if (op == BRAID_AVG) {
    acc /= g_world;
    if (t != BRAID_FLOAT16 && t != BRAID_FLOAT32 && t != BRAID_FLOAT64 && t != BRAID_BFLOAT16)
      acc = trunc(acc);
  }
  return acc;
}

static void fill(braid_dtype t, braid_redop op, void *buf, size_t count, int rank) {
  for (size_t i = 0; i < count; i++) put(t, buf, i, input(rank, i, t, op));
}

static void expect_reduced(const char *what, braid_dtype t, braid_redop op, const void *buf,
                           size_t count) {
  for (size_t i = 0; i < count; i++) {
    double got = get(t, buf, i), want = expected(i, t, op);
    EXPECT(got == want, "%s %s %s: element %zu is %g, expected %g", what, dtype_name(t),
           op_name(op), i, got, want);
  }
  g_checks++;
}

static void expect_input(const char *what, braid_dtype t, braid_redop op, const void *buf,
                         size_t count, int rank) {
  for (size_t i = 0; i < count; i++) {
    double got = get(t, buf, i), want = input(rank, i, t, op);
    EXPECT(got == want, "%s %s: element %zu is %g, expected %g", what, dtype_name(t), i, got,
           want);
  }
  g_checks++;
}

/* A registered send buffer: the same results, rewritten between collectives while registered; an
 * overlapping registration is refused; deregistering twice is harmless. Over shared memory and TCP
 * nothing sends without a copy, which zero_copy says. */
static void registered(braid_comm *comm, int rank) {
  size_t n = 300007;
  float *send = malloc(n * sizeof(float)), *recv = malloc(n * sizeof(float));
  EXPECT(send && recv, "out of memory");
  fill(BRAID_FLOAT32, BRAID_SUM, send, n, rank);
  int zero_copy = -1;
  CHECK(braid_comm_register(comm, send, n * sizeof(float), &zero_copy));
  EXPECT(zero_copy == 0, "zero_copy %d over shared memory", zero_copy);
  EXPECT(braid_comm_register(comm, send + 10, 100, NULL) == BRAID_INVALID_ARGUMENT,
         "an overlapping registration was accepted");
  EXPECT(strstr(braid_get_last_error_message(), "overlaps"), "message: %s",
         braid_get_last_error_message());
  /* Rewritten between collectives while registered: each result is of the data sent now. */
  const braid_redop ops[] = {BRAID_SUM, BRAID_MAX, BRAID_PROD, BRAID_MIN};
  for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
    fill(BRAID_FLOAT32, ops[k], send, n, rank);
    CHECK(braid_all_reduce(send, recv, n, BRAID_FLOAT32, ops[k], comm, NULL));
    expect_reduced("all_reduce from a registered buffer", BRAID_FLOAT32, ops[k], recv, n);
  }
  CHECK(braid_comm_deregister(comm, send, n * sizeof(float)));
  CHECK(braid_comm_deregister(comm, send, n * sizeof(float)));
  free(send);
  free(recv);
}

static void all_reduce(braid_comm *comm, int rank) {
  const size_t counts[] = {0, 1, 1000};
  for (braid_dtype t = BRAID_INT8; t <= BRAID_BFLOAT16; t++) {
    for (braid_redop op = BRAID_SUM; op <= BRAID_AVG; op++) {
      for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        size_t n = counts[k], es = dtype_size(t);
        /* Out of place, both buffers one byte off alignment. */
        char *sraw = malloc(n * es + 1), *rraw = malloc(n * es + 1);
        void *send = sraw + 1, *recv = rraw + 1;
        fill(t, op, send, n, rank);
        memset(recv, 0x5a, n * es);
        CHECK(braid_all_reduce(n ? send : NULL, n ? recv : NULL, n, t, op, comm, NULL));
        expect_reduced("all_reduce", t, op, recv, n);
        expect_input("all_reduce leaves sendbuf alone", t, op, send, n, rank);
        /* In place, aligned. */
        void *buf = malloc(n * es + 1);
        fill(t, op, buf, n, rank);
        CHECK(braid_all_reduce(buf, buf, n, t, op, comm, NULL));
        expect_reduced("all_reduce in place", t, op, buf, n);
        free(sraw);
        free(rraw);
        free(buf);
      }
    }
  }
  /* A size that spans many transport slots. */
  size_t n = 300007;
  float *big = malloc(n * sizeof(float));
  fill(BRAID_FLOAT32, BRAID_SUM, big, n, rank);
  CHECK(braid_all_reduce(big, big, n, BRAID_FLOAT32, BRAID_SUM, comm, NULL));
  expect_reduced("large all_reduce", BRAID_FLOAT32, BRAID_SUM, big, n);
  free(big);
}

static void reduce_scatter(braid_comm *comm, int rank) {
  const braid_dtype types[] = {BRAID_FLOAT32, BRAID_INT32, BRAID_FLOAT64, BRAID_BFLOAT16};
  for (size_t k = 0; k < 4; k++) {
    braid_dtype t = types[k];
    for (braid_redop op = BRAID_SUM; op <= BRAID_AVG; op++) {
      size_t n = 37, es = dtype_size(t), total = n * (size_t)g_world;
      char *send = malloc(total * es), *recv = malloc(n * es);
      fill(t, op, send, total, rank);
      CHECK(braid_reduce_scatter(send, recv, n, t, op, comm, NULL));
      /* Rank r's block starts at element r·n of everyone's input. */
      for (size_t i = 0; i < n; i++) {
        double got = get(t, recv, i), want = expected(rank * n + i, t, op);
        EXPECT(got == want, "reduce_scatter %s %s: element %zu is %g, expected %g",
               dtype_name(t), op_name(op), i, got, want);
      }
      expect_input("reduce_scatter leaves sendbuf alone", t, op, send, total, rank);
      /* In place: recvbuf = sendbuf + rank·recvcount. Unaligned base for bfloat16. */
      char *raw = malloc(total * es + 1);
      char *buf = t == BRAID_BFLOAT16 ? raw + 1 : raw;
      fill(t, op, buf, total, rank);
      CHECK(braid_reduce_scatter(buf, buf + (size_t)rank * n * es, n, t, op, comm, NULL));
      for (size_t i = 0; i < n; i++) {
        double got = get(t, buf + (size_t)rank * n * es, i), want = expected(rank * n + i, t, op);
        EXPECT(got == want, "reduce_scatter in place %s %s: element %zu is %g, expected %g",
               dtype_name(t), op_name(op), i, got, want);
      }
      g_checks += 2;
      free(send);
      free(recv);
      free(raw);
    }
  }
}

static void all_gather(braid_comm *comm, int rank) {
  const braid_dtype types[] = {BRAID_FLOAT32, BRAID_UINT8, BRAID_INT64, BRAID_FLOAT16};
  for (size_t k = 0; k < 4; k++) {
    braid_dtype t = types[k];
    size_t n = 53, es = dtype_size(t), total = n * (size_t)g_world;
    char *send = malloc(n * es), *recv = malloc(total * es);
    fill(t, BRAID_SUM, send, n, rank);
    CHECK(braid_all_gather(send, recv, n, t, comm, NULL));
    for (int r = 0; r < g_world; r++)
      expect_input("all_gather block", t, BRAID_SUM, recv + (size_t)r * n * es, n, r);
    /* In place: sendbuf = recvbuf + rank·sendcount; unaligned for float16. */
    char *raw = malloc(total * es + 1);
    char *buf = t == BRAID_FLOAT16 ? raw + 1 : raw;
    memset(buf, 0, total * es);
    fill(t, BRAID_SUM, buf + (size_t)rank * n * es, n, rank);
    CHECK(braid_all_gather(buf + (size_t)rank * n * es, buf, n, t, comm, NULL));
    for (int r = 0; r < g_world; r++)
      expect_input("all_gather in place block", t, BRAID_SUM, buf + (size_t)r * n * es, n, r);
    free(send);
    free(recv);
    free(raw);
  }
}

static void broadcast_and_reduce(braid_comm *comm, int rank) {
  size_t n = 777;
  for (int root = 0; root < g_world; root++) {
    /* Broadcast, out of place: non-roots pass NULL as sendbuf. */
    double *send = malloc(n * sizeof(double)), *recv = malloc(n * sizeof(double));
    fill(BRAID_FLOAT64, BRAID_SUM, send, n, root);
    memset(recv, 0, n * sizeof(double));
    CHECK(braid_broadcast(rank == root ? send : NULL, recv, n, BRAID_FLOAT64, root, comm, NULL));
    expect_input("broadcast", BRAID_FLOAT64, BRAID_SUM, recv, n, root);
    /* In place, unaligned int32. */
    char *raw = malloc(n * 4 + 1), *buf = raw + 1;
    if (rank == root) fill(BRAID_INT32, BRAID_SUM, buf, n, root);
    else memset(buf, 0x7f, n * 4);
    CHECK(braid_broadcast(buf, buf, n, BRAID_INT32, root, comm, NULL));
    expect_input("broadcast in place", BRAID_INT32, BRAID_SUM, buf, n, root);
    /* Reduce, out of place: non-roots pass NULL as recvbuf. */
    for (braid_redop op = BRAID_SUM; op <= BRAID_AVG; op++) {
      int32_t *s = malloc(n * 4), *r = malloc(n * 4);
      fill(BRAID_INT32, op, s, n, rank);
      memset(r, 0, n * 4);
      CHECK(braid_reduce(s, rank == root ? r : NULL, n, BRAID_INT32, op, root, comm, NULL));
      if (rank == root) expect_reduced("reduce", BRAID_INT32, op, r, n);
      expect_input("reduce leaves sendbuf alone", BRAID_INT32, op, s, n, rank);
      /* In place. */
      fill(BRAID_INT32, op, s, n, rank);
      CHECK(braid_reduce(s, s, n, BRAID_INT32, op, root, comm, NULL));
      if (rank == root) expect_reduced("reduce in place", BRAID_INT32, op, s, n);
      else expect_input("reduce in place leaves non-root buffers alone", BRAID_INT32, op, s, n, rank);
      free(s);
      free(r);
    }
    free(send);
    free(recv);
    free(raw);
  }
}

static void async_variants(braid_comm *comm, int rank) {
  enum { K = 4 };
  size_t n = 4099;
  float *bufs[K], *outs[K];
  braid_work *works[K];
  /* Several in flight at once, half in place, waited in reverse order. */
  for (int k = 0; k < K; k++) {
    bufs[k] = malloc(n * sizeof(float));
    outs[k] = k % 2 ? bufs[k] : malloc(n * sizeof(float));
    fill(BRAID_FLOAT32, BRAID_SUM, bufs[k], n, rank + k);
    CHECK(braid_all_reduce_async(bufs[k], outs[k], n, BRAID_FLOAT32, BRAID_SUM, comm, NULL,
                                 &works[k]));
  }
  for (int k = K - 1; k >= 0; k--) {
    CHECK(braid_work_wait(works[k]));
    CHECK(braid_work_wait(works[k])); /* a second wait returns the same result */
    for (size_t i = 0; i < n; i++) {
      double want = 0;
      for (int r = 0; r < g_world; r++) want += input(r + k, i, BRAID_FLOAT32, BRAID_SUM);
      EXPECT(outs[k][i] == want, "all_reduce_async %d: element %zu is %g, expected %g", k, i,
             outs[k][i], want);
    }
    CHECK(braid_work_free(works[k]));
    if (!(k % 2)) free(outs[k]);
    free(bufs[k]);
    g_checks++;
  }
  /* braid_work_test until done: the result is then in recvbuf without a wait. */
  int64_t *x = malloc(n * 8);
  fill(BRAID_INT64, BRAID_MAX, x, n, rank);
  braid_work *w;
  CHECK(braid_all_reduce_async(x, x, n, BRAID_INT64, BRAID_MAX, comm, NULL, &w));
  int done = 0;
  for (long spins = 0; !done; spins++) {
    CHECK(braid_work_test(w, &done));
    EXPECT(spins < 100000000L, "braid_work_test never reported done");
  }
  expect_reduced("all_reduce_async tested", BRAID_INT64, BRAID_MAX, x, n);
  CHECK(braid_work_free(w));
  free(x);
  /* All-gather, broadcast and barrier. */
  uint8_t *mine = malloc(n), *all = malloc(n * (size_t)g_world);
  fill(BRAID_UINT8, BRAID_SUM, mine, n, rank);
  CHECK(braid_all_gather_async(mine, all, n, BRAID_UINT8, comm, NULL, &w));
  /* No copies: sendbuf stays untouched until the work completes. */
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  for (int r = 0; r < g_world; r++)
    expect_input("all_gather_async block", BRAID_UINT8, BRAID_SUM, all + (size_t)r * n, n, r);
  int root = g_world - 1;
  double *b = malloc(n * sizeof(double));
  if (rank == root) fill(BRAID_FLOAT64, BRAID_SUM, b, n, root);
  else memset(b, 0, n * sizeof(double));
  CHECK(braid_broadcast_async(b, b, n, BRAID_FLOAT64, root, comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  expect_input("broadcast_async", BRAID_FLOAT64, BRAID_SUM, b, n, root);
  /* Freeing unfinished work waits for it: the buffer holds the result afterwards. */
  fill(BRAID_FLOAT64, BRAID_SUM, b, n, rank);
  CHECK(braid_all_reduce_async(b, b, n, BRAID_FLOAT64, BRAID_SUM, comm, NULL, &w));
  CHECK(braid_work_free(w));
  expect_reduced("all_reduce_async freed unfinished", BRAID_FLOAT64, BRAID_SUM, b, n);
  CHECK(braid_barrier_async(comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  /* Work freed before completion: the op still runs, in order, and the next collective works. */
  float one = 1;
  CHECK(braid_all_reduce_async(&one, &one, 1, BRAID_FLOAT32, BRAID_SUM, comm, NULL, &w));
  CHECK(braid_work_free(w));
  float two = 2;
  CHECK(braid_all_reduce(&two, &two, 1, BRAID_FLOAT32, BRAID_SUM, comm, NULL));
  EXPECT(two == 2.0f * g_world, "all_reduce after a freed work gave %g", two);
  free(mine);
  free(all);
  free(b);
  g_checks += 4;
}

/* A completion callback: counts its calls and keeps the last result, from whichever thread. */
struct completion {
  int calls;
  int result;
};

static void on_done(void *user, braid_result result) {
  struct completion *c = user;
  __atomic_store_n(&c->result, (int)result, __ATOMIC_RELAXED);
  __atomic_add_fetch(&c->calls, 1, __ATOMIC_RELEASE);
}

/* The bitwise reductions: integers of every width against values computed here, floats refused without
 * effect (the communicator still works afterwards). */
static void bitwise(braid_comm *comm, int rank) {
  size_t n = 777;
  braid_redop ops[3] = {BRAID_BAND, BRAID_BOR, BRAID_BXOR};
  for (int k = 0; k < 3; k++) {
    uint64_t *u = malloc(n * 8);
    uint8_t *b = malloc(n);
    int32_t *s = malloc(n * 4);
    for (size_t i = 0; i < n; i++) {
      u[i] = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1) ^ ((uint64_t)rank << (i % 60));
      b[i] = (uint8_t)(i * 37 + (size_t)rank * 101);
      s[i] = (int32_t)(i * 2654435761u) ^ (rank * 7919);
    }
    CHECK(braid_all_reduce(u, u, n, BRAID_UINT64, ops[k], comm, NULL));
    CHECK(braid_all_reduce(b, b, n, BRAID_UINT8, ops[k], comm, NULL));
    CHECK(braid_all_reduce(s, s, n, BRAID_INT32, ops[k], comm, NULL));
    for (size_t i = 0; i < n; i++) {
      uint64_t wu = 0;
      uint8_t wb = 0;
      int32_t ws = 0;
      for (int r = 0; r < g_world; r++) {
        uint64_t xu = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1) ^ ((uint64_t)r << (i % 60));
        uint8_t xb = (uint8_t)(i * 37 + (size_t)r * 101);
        int32_t xs = (int32_t)(i * 2654435761u) ^ (r * 7919);
        if (r == 0) {
          wu = xu, wb = xb, ws = xs;
        } else if (ops[k] == BRAID_BAND) {
          wu &= xu, wb &= xb, ws &= xs;
        } else if (ops[k] == BRAID_BOR) {
          wu |= xu, wb |= xb, ws |= xs;
        } else {
          wu ^= xu, wb ^= xb, ws ^= xs;
        }
      }
      EXPECT(u[i] == wu && b[i] == wb && s[i] == ws, "bitwise op %d element %zu: %llx %x %x, expected %llx %x %x",
             ops[k], i, (unsigned long long)u[i], b[i], s[i], (unsigned long long)wu, wb, ws);
    }
    free(u);
    free(b);
    free(s);
    g_checks++;
  }
  float f[4] = {1, 2, 3, 4}, g[4];
  EXPECT(braid_all_reduce(f, g, 4, BRAID_FLOAT32, BRAID_BAND, comm, NULL) == BRAID_INVALID_ARGUMENT,
         "a bitwise reduction of floats was not refused");
  EXPECT(strstr(braid_get_last_error_message(), "integer") != NULL, "the refusal says: %s",
         braid_get_last_error_message());
  EXPECT(f[0] == 1 && f[3] == 4, "a refused reduction changed its input");
  braid_work *w;
  EXPECT(braid_all_reduce_async(f, f, 4, BRAID_BFLOAT16, BRAID_BXOR, comm, NULL, &w) == BRAID_INVALID_ARGUMENT,
         "an asynchronous bitwise reduction of floats was not refused");
  EXPECT(braid_all_reduce(f, f, 4, BRAID_FLOAT32, 8, comm, NULL) == BRAID_INVALID_ARGUMENT, "op 8 was not refused");
  CHECK(braid_all_reduce(f, g, 4, BRAID_FLOAT32, BRAID_SUM, comm, NULL));
  EXPECT(g[3] == 4.0f * g_world, "the sum after the refusals is %g", g[3]);
  g_checks++;
}

static void async_more(braid_comm *comm, int rank) {
  size_t n = 1031;
  braid_work *w;
  /* Reduce-scatter: block r of every rank's input, reduced, on rank r; out of place and in place. */
  int32_t *in = malloc(n * (size_t)g_world * 4), *out = malloc(n * 4);
  for (size_t i = 0; i < n * (size_t)g_world; i++) in[i] = (int32_t)(i * 7 + (size_t)rank);
  CHECK(braid_reduce_scatter_async(in, out, n, BRAID_INT32, BRAID_SUM, comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  for (size_t i = 0; i < n; i++) {
    int64_t want = 0;
    for (int r = 0; r < g_world; r++) want += (int64_t)(((size_t)rank * n + i) * 7 + (size_t)r);
    EXPECT(out[i] == (int32_t)want, "reduce_scatter_async: element %zu is %d, expected %lld", i, out[i],
           (long long)want);
  }
  CHECK(braid_reduce_scatter_async(in, in + (size_t)rank * n, n, BRAID_INT32, BRAID_SUM, comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  EXPECT(memcmp(in + (size_t)rank * n, out, n * 4) == 0, "reduce_scatter_async in place differs");
  /* Reduce to every root; NULL recvbuf off the root. */
  for (int root = 0; root < g_world; root++) {
    fill(BRAID_INT32, BRAID_MAX, in, n, rank);
    memset(out, 0, n * 4);
    CHECK(braid_reduce_async(in, rank == root ? out : NULL, n, BRAID_INT32, BRAID_MAX, root, comm, NULL, &w));
    CHECK(braid_work_wait(w));
    CHECK(braid_work_free(w));
    if (rank == root) expect_reduced("reduce_async", BRAID_INT32, BRAID_MAX, out, n);
    expect_input("reduce_async leaves sendbuf alone", BRAID_INT32, BRAID_MAX, in, n, rank);
  }
  /* All-to-all: block j of rank r holds r * 1000 + j * 10 + k. */
  size_t b = 5;
  int64_t *a = malloc(b * (size_t)g_world * 8), *c = malloc(b * (size_t)g_world * 8);
  for (int j = 0; j < g_world; j++)
    for (size_t k = 0; k < b; k++) a[(size_t)j * b + k] = rank * 1000 + j * 10 + (int64_t)k;
  CHECK(braid_all_to_all_async(a, c, b, BRAID_INT64, comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  for (int p = 0; p < g_world; p++)
    for (size_t k = 0; k < b; k++)
      EXPECT(c[(size_t)p * b + k] == p * 1000 + rank * 10 + (int64_t)k, "all_to_all_async: block %d element %zu is %lld",
             p, k, (long long)c[(size_t)p * b + k]);
  /* All-to-all of uneven blocks: rank r sends r + j + 1 elements to rank j, in reverse rank order. */
  size_t scount[8], sdispl[8], rcount[8], rdispl[8], slen = 0, rlen = 0;
  for (int j = g_world - 1; j >= 0; j--) {
    scount[j] = (size_t)(rank + j + 1);
    sdispl[j] = slen;
    slen += scount[j];
  }
  for (int p = 0; p < g_world; p++) {
    rcount[p] = (size_t)(p + rank + 1);
    rdispl[p] = rlen;
    rlen += rcount[p];
  }
  uint16_t *vs = malloc(slen * 2), *vr = malloc(rlen * 2);
  for (int j = 0; j < g_world; j++)
    for (size_t k = 0; k < scount[j]; k++) vs[sdispl[j] + k] = (uint16_t)(rank * 100 + j * 10 + (int)k);
  CHECK(braid_all_to_all_v_async(vs, slen, scount, sdispl, vr, rlen, rcount, rdispl, BRAID_FLOAT16, comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  for (int p = 0; p < g_world; p++)
    for (size_t k = 0; k < rcount[p]; k++)
      EXPECT(vr[rdispl[p] + k] == (uint16_t)(p * 100 + rank * 10 + (int)k),
             "all_to_all_v_async: from rank %d element %zu is %u", p, k, vr[rdispl[p] + k]);
  /* A block past the buffer is refused before anything runs. */
  rcount[0] = rlen + 1;
  EXPECT(braid_all_to_all_v_async(vs, slen, scount, sdispl, vr, rlen, rcount, rdispl, BRAID_FLOAT16, comm, NULL, &w) ==
             BRAID_INVALID_ARGUMENT,
         "an all_to_all_v block past the receive buffer was not refused");
  /* Completion callbacks: registered before the op completes (called on braid's thread), after it
   * completed (called at once, here), and only one per work. */
  struct completion before = {0, -1}, after = {0, -1}, second = {0, -1};
  float *f = malloc(n * sizeof(float));
  fill(BRAID_FLOAT32, BRAID_SUM, f, n, rank);
  CHECK(braid_all_reduce_async(f, f, n, BRAID_FLOAT32, BRAID_SUM, comm, NULL, &w));
  CHECK(braid_work_on_complete(w, on_done, &before));
  EXPECT(braid_work_on_complete(w, on_done, &second) == BRAID_INVALID_ARGUMENT,
         "a second completion callback was not refused");
  EXPECT(braid_work_on_complete(w, NULL, &second) == BRAID_INVALID_ARGUMENT, "a NULL callback was not refused");
  for (long spins = 0; __atomic_load_n(&before.calls, __ATOMIC_ACQUIRE) == 0; spins++) {
    EXPECT(spins < 2000000000L, "the completion callback never came");
    sched_yield();
  }
  EXPECT(before.result == BRAID_SUCCESS, "the completion callback got %d", before.result);
  expect_reduced("all_reduce_async with a callback", BRAID_FLOAT32, BRAID_SUM, f, n);
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  CHECK(braid_barrier_async(comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_on_complete(w, on_done, &after));
  EXPECT(after.calls == 1 && after.result == BRAID_SUCCESS, "a callback on completed work: %d calls, result %d",
         after.calls, after.result);
  CHECK(braid_work_free(w));
  EXPECT(before.calls == 1 && second.calls == 0, "callbacks called %d and %d times", before.calls, second.calls);
  free(f);
  free(vs);
  free(vr);
  free(a);
  free(c);
  free(in);
  free(out);
  g_checks += 8;
}

/* Gradient buckets: three parameters in two buckets, marked in a rank-dependent order, the results
 * written in place by finish; the layout, refusals, a second step after the rebuild, and compressed
 * buckets (fp16 of small integers: exact). */
static void buckets(braid_comm *comm, int rank) {
  size_t counts[3] = {1000, 17, 5};
  braid_dtype dtypes[3] = {BRAID_FLOAT32, BRAID_INT32, BRAID_FLOAT64};
  braid_buckets *b = NULL;
  EXPECT(braid_buckets_create(&b, comm, 3, counts, dtypes, BRAID_SUM, 0, NULL, 8) == BRAID_INVALID_ARGUMENT,
         "unknown bucket flags were not refused");
  CHECK(braid_buckets_create(&b, comm, 3, counts, dtypes, BRAID_SUM, 4096, NULL, 0));
  size_t nb = 0, of[3] = {9, 9, 9}, order[3] = {9, 9, 9};
  CHECK(braid_buckets_layout(b, order, of, 3, &nb));
  EXPECT(nb == 3 && of[2] == 0 && of[1] == 1 && of[0] == 2, "layout: %zu buckets, %zu %zu %zu", nb, of[0], of[1],
         of[2]);
  EXPECT(order[0] == 2 && order[1] == 1 && order[2] == 0, "layout order %zu %zu %zu", order[0], order[1], order[2]);
  EXPECT(braid_buckets_layout(b, order, NULL, 2, NULL) == BRAID_INVALID_ARGUMENT, "a short order array was accepted");
  float *f = malloc(1000 * 4);
  int32_t i32[17];
  double f64[5];
  for (int step = 0; step < 2; step++) {
    for (size_t i = 0; i < 1000; i++) f[i] = (float)(rank + (int)i % 7 + step);
    for (size_t i = 0; i < 17; i++) i32[i] = rank * 3 + (int32_t)i;
    for (size_t i = 0; i < 5; i++) f64[i] = rank + 0.5 * (double)i;
    EXPECT(braid_buckets_mark_ready(b, 3, f, 1000, BRAID_FLOAT32, f) == BRAID_INVALID_ARGUMENT,
           "parameter 3 of 3 was not refused");
    EXPECT(braid_buckets_mark_ready(b, 0, f, 1000, BRAID_FLOAT64, f) == BRAID_INVALID_ARGUMENT,
           "a gradient of the wrong dtype was not refused");
    if (rank % 2) {
      CHECK(braid_buckets_mark_ready(b, 0, f, 1000, BRAID_FLOAT32, f));
      CHECK(braid_buckets_mark_ready(b, 1, i32, 17, BRAID_INT32, i32));
      CHECK(braid_buckets_mark_ready(b, 2, f64, 5, BRAID_FLOAT64, f64));
    } else {
      CHECK(braid_buckets_mark_ready(b, 2, f64, 5, BRAID_FLOAT64, f64));
      CHECK(braid_buckets_mark_ready(b, 1, i32, 17, BRAID_INT32, i32));
      CHECK(braid_buckets_mark_ready(b, 0, f, 1000, BRAID_FLOAT32, NULL));
    }
    EXPECT(braid_buckets_mark_ready(b, 1, i32, 17, BRAID_INT32, i32) == BRAID_INVALID_ARGUMENT,
           "a second mark in one step was not refused");
    CHECK(braid_buckets_finish(b));
    int w = g_world, rs = w * (w - 1) / 2;
    for (size_t i = 0; i < 17; i++)
      EXPECT(i32[i] == 3 * rs + w * (int32_t)i, "step %d: bucketed int32 %zu is %d", step, i, i32[i]);
    for (size_t i = 0; i < 5; i++)
      EXPECT(f64[i] == rs + w * 0.5 * (double)i, "step %d: bucketed double %zu is %g", step, i, f64[i]);
    float *g = rank % 2 ? f : malloc(1000 * 4);
    if (!(rank % 2)) CHECK(braid_buckets_gradient(b, 0, g, 1000, BRAID_FLOAT32));
    for (size_t i = 0; i < 1000; i++)
      EXPECT(g[i] == (float)(rs + w * ((int)i % 7 + step)), "step %d: bucketed float %zu is %g", step, i, g[i]);
    if (g != f) free(g);
  }
  /* Rank 0 marked 2, 1, 0 (the first layout's order): the rebuild keeps three buckets. */
  CHECK(braid_buckets_layout(b, NULL, NULL, 0, &nb));
  EXPECT(nb == 3, "%zu buckets after the rebuild", nb);
  CHECK(braid_buckets_destroy(b));
  EXPECT(braid_buckets_finish(b) == BRAID_INVALID_ARGUMENT, "a destroyed bucket handle was accepted");
  /* Compressed: every bucket through its own fp16 compressor. */
  braid_dtype floats[3] = {BRAID_FLOAT32, BRAID_FLOAT32, BRAID_FLOAT32};
  EXPECT(braid_buckets_create(&b, comm, 3, counts, dtypes, BRAID_SUM, 4096, "fp16", 0) == BRAID_INVALID_ARGUMENT,
         "compressed buckets of int32 were not refused");
  EXPECT(braid_buckets_create(&b, comm, 3, counts, floats, BRAID_SUM, 4096, "nonsense", 0) == BRAID_INVALID_ARGUMENT,
         "a bad compression text was not refused");
  CHECK(braid_buckets_create(&b, comm, 3, counts, floats, BRAID_SUM, 2048, "fp16", 0));
  float *p[3];
  for (int k = 0; k < 3; k++) {
    p[k] = malloc(counts[k] * 4);
    for (size_t i = 0; i < counts[k]; i++) p[k][i] = (float)(rank + k + (int)(i % 5));
  }
  for (int k = 2; k >= 0; k--) CHECK(braid_buckets_mark_ready(b, (size_t)k, p[k], counts[k], BRAID_FLOAT32, p[k]));
  CHECK(braid_buckets_finish(b));
  for (int k = 0; k < 3; k++) {
    for (size_t i = 0; i < counts[k]; i++) {
      float want = (float)(g_world * (g_world - 1) / 2 + g_world * (k + (int)(i % 5)));
      EXPECT(p[k][i] == want, "compressed bucket: parameter %d element %zu is %g, expected %g", k, i, p[k][i], want);
    }
    free(p[k]);
  }
  CHECK(braid_buckets_destroy(b));
  free(f);
  g_checks += 6;
}

/* Shared buffers: memory every rank maps, collectives straight through it, refusals that agree. */
static void shared_memory(braid_comm *comm, int rank) {
  void *p = NULL;
  EXPECT(braid_mem_alloc(comm, 4096, NULL) == BRAID_INVALID_ARGUMENT, "a NULL out was not refused");
  EXPECT(braid_mem_alloc(comm, rank == 0 ? 0 : 4096, &p) == BRAID_INVALID_ARGUMENT && p == NULL,
         "0 bytes on rank 0 was not refused on every rank");
  size_t n = 100003;
  float *a = NULL, *b = NULL;
  CHECK(braid_mem_alloc(comm, n * sizeof(float), (void **)&a));
  CHECK(braid_mem_alloc(comm, n * sizeof(float), (void **)&b));
  EXPECT(((uintptr_t)a % 4096) == 0 && a[0] == 0.0f && a[n - 1] == 0.0f, "shared memory is not zeroed pages");
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i < n; i++) a[i] = (float)((int)(i % 13) + rank + round);
    CHECK(braid_all_reduce(a, b, n, BRAID_FLOAT32, BRAID_SUM, comm, NULL));
    CHECK(braid_all_reduce(a, a, n, BRAID_FLOAT32, BRAID_MAX, comm, NULL));
    int w = g_world, rs = w * (w - 1) / 2;
    for (size_t i = 0; i < n; i++) {
      EXPECT(b[i] == (float)(w * ((int)(i % 13) + round) + rs), "shared sum %zu is %g", i, b[i]);
      EXPECT(a[i] == (float)((int)(i % 13) + w - 1 + round), "shared max %zu is %g", i, a[i]);
    }
  }
  /* Small: through the boards. */
  double d[3] = {rank, 1, -rank};
  double *s = NULL;
  CHECK(braid_mem_alloc(comm, sizeof d, (void **)&s));
  memcpy(s, d, sizeof d);
  CHECK(braid_all_reduce(s, s, 3, BRAID_FLOAT64, BRAID_SUM, comm, NULL));
  EXPECT(s[1] == g_world && s[0] == -s[2], "small shared all-reduce: %g %g %g", s[0], s[1], s[2]);
  EXPECT(braid_mem_free(comm, d) == BRAID_INVALID_ARGUMENT, "freeing memory braid did not allocate was accepted");
  CHECK(braid_mem_free(comm, s));
  EXPECT(braid_mem_free(comm, s) == BRAID_INVALID_ARGUMENT, "a double free was accepted");
  CHECK(braid_mem_free(comm, NULL));
  CHECK(braid_mem_free(comm, a));
  CHECK(braid_mem_free(comm, b));
}

int main(void) {
  const char *root = getenv("BRAID_ROOT"), *secret = getenv("BRAID_SECRET");
  const char *rank_s = getenv("BRAID_RANK"), *world_s = getenv("BRAID_WORLD_SIZE");
  EXPECT(root && secret && rank_s && world_s, "run me under `braid run -n N`");
  g_rank = atoi(rank_s);
  g_world = atoi(world_s);

  int version = 0;
  CHECK(braid_get_version(&version));
  EXPECT(version == BRAID_VERSION_CODE, "library version %d, header %d", version,
         BRAID_VERSION_CODE);

  /* The id from the launcher's variables, and a config with a timeout and argument checks. */
  braid_unique_id id;
  memset(&id, 0, sizeof id);
  snprintf(id.internal, sizeof id.internal, "%s/%s", root, secret);
  braid_config cfg;
  CHECK(braid_config_init(&cfg));
  cfg.timeout_ms = 60000;
  cfg.debug_checks = 1;
  braid_comm *comm = NULL;
  CHECK(braid_comm_init_rank(&comm, g_world, id, g_rank, &cfg));
  int n = 0, r = -1;
  CHECK(braid_comm_count(comm, &n));
  CHECK(braid_comm_rank(comm, &r));
  EXPECT(n == g_world && r == g_rank, "count %d rank %d, expected %d %d", n, r, g_world, g_rank);

  all_reduce(comm, g_rank);
  registered(comm, g_rank);
  reduce_scatter(comm, g_rank);
  all_gather(comm, g_rank);
  broadcast_and_reduce(comm, g_rank);
  async_variants(comm, g_rank);
  async_more(comm, g_rank);
  bitwise(comm, g_rank);
  buckets(comm, g_rank);
  shared_memory(comm, g_rank);
  uint64_t t0 = 0, t1 = 0;
  CHECK(braid_timeline_now(&t0));
  CHECK(braid_timeline_now(&t1));
  EXPECT(t0 > 0 && t1 >= t0, "timeline clock %llu then %llu", (unsigned long long)t0, (unsigned long long)t1);
  CHECK(braid_timeline_event(comm, "compute", t0, t1));
  EXPECT(braid_timeline_event(comm, "backwards", t1 + 1, t1) == BRAID_INVALID_ARGUMENT,
         "a span ending before it starts was not refused");
  EXPECT(braid_timeline_event(comm, NULL, t0, t1) == BRAID_INVALID_ARGUMENT, "a NULL span name was not refused");
  CHECK(braid_timeline_flush(comm));
  CHECK(braid_barrier(comm, NULL));

  braid_result async_rc = BRAID_INTERNAL;
  CHECK(braid_comm_get_async_error(comm, &async_rc));
  EXPECT(async_rc == BRAID_SUCCESS, "async error %d: %s", async_rc,
         braid_get_last_error_message());
  CHECK(braid_comm_destroy(comm));
  printf("rank %d: collectives ok (%ld checks)\n", g_rank, g_checks);
  return 0;
}
