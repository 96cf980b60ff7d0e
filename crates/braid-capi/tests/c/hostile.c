/* Hostile input to every entry point of braid.h. Each row of CASES makes one bad call and expects a
 * result code, a last error message naming the argument, and no effect: the caller's buffers and output
 * handles unchanged, the communicator still usable. Every rank runs the same table (the rejections
 * happen before any communication), then a real collective proves the communicator survived.
 * Run as every rank of `braid run -n N`.
 *
 *  #  call                        hostile input                                     expect
 *  1  all_reduce                  comm NULL                                         "comm is NULL"
 *  2  all_reduce                  comm a forged handle                              "not a live braid_comm"
 *  3  all_reduce                  dtype 42                                          "dtype 42"
 *  4  all_reduce                  dtype -1                                          "dtype -1"
 *  5  all_reduce                  op 99                                             "op 99"
 *  6  all_reduce                  op -3                                             "op -3"
 *  7  all_reduce                  sendbuf NULL, count 4                             "sendbuf is NULL"
 *  8  all_reduce                  recvbuf NULL, count 4                             "recvbuf is NULL"
 *  9  all_reduce                  count SIZE_MAX (float)                            "overflows"
 * 10  all_reduce                  count SIZE_MAX/4 + 1 (float: bytes wrap)          "overflows"
 * 11  all_reduce                  count SIZE_MAX/2 + 1 (uint8: past isize)          "overflows"
 * 12  all_reduce                  sendbuf 8 bytes below the top of memory           "end of the address space"
 * 13  all_reduce                  recvbuf = sendbuf + 1 element (partial overlap)   "overlap"
 * 14  all_reduce                  stream not NULL, no device                        "has no device"
 * 15  reduce_scatter              recvbuf inside sendbuf, not at rank's block       "overlap"
 * 16  reduce_scatter              recvcount · nranks overflows                      "recvcount"
 * 17  all_gather                  sendcount · nranks overflows                      "sendcount"
 * 18  all_gather                  recvbuf NULL, sendcount 2                         "recvbuf is NULL"
 * 19  all_gather                  sendbuf inside recvbuf at the wrong block         "overlap"
 * 20  broadcast                   root -1                                           "root -1"
 * 21  broadcast                   root == nranks                                    "out of range"
 * 22  reduce                      root 1000                                         "root 1000"
 * 23  reduce                      op 8                                              "op 8"
 * 24  barrier                     comm NULL                                         "comm is NULL"
 * 25  barrier                     stream not NULL                                   "stream"
 * 26  comm_count                  out NULL                                          "out is NULL"
 * 27  comm_rank                   forged handle                                     "not a live braid_comm"
 * 28  comm_get_async_error        out NULL                                          "out is NULL"
 * 29  comm_abort                  comm NULL                                         "comm is NULL"
 * 30  comm_init_rank              out NULL                                          "out is NULL"
 * 31  comm_init_rank              nranks -2                                         "nranks is negative"
 * 32  comm_init_rank              nranks 0                                          "nranks is 0"
 * 33  comm_init_rank              rank -1                                           "rank is negative"
 * 34  comm_init_rank              rank == nranks                                    "out of range"
 * 35  comm_init_rank              id without a NUL in 128 bytes                     "NUL-terminated"
 * 36  comm_init_rank              id text that is not an id                         "not a braid unique id"
 * 37  comm_init_rank              cfg->magic wrong                                  "magic"
 * 38  comm_init_rank              cfg->version 99                                   "version"
 * 39  comm_init_rank              cfg->size 12                                      "size"
 * 40  comm_init_rank              cfg->reserved[5] set                              "reserved"
 * 41  comm_init_rank              cfg->debug_checks 5                               "debug_checks"
 * 42  comm_init_rank              cfg->timeout_ms beyond a day                      "timeout_ms"
 * 43  config_init                 cfg NULL                                          "cfg is NULL"
 * 44  get_unique_id               out NULL                                          "out is NULL"
 * 45  get_version                 version NULL                                      "version is NULL"
 * 46  all_reduce_async            out NULL                                          "out is NULL"
 * 47  all_reduce_async            stream not NULL                                   "stream"
 * 48  all_gather_async            sendbuf NULL, sendcount 3                         "sendbuf is NULL"
 * 49  broadcast_async             root 9999                                         "root 9999"
 * 50  barrier_async               out NULL                                          "out is NULL"
 * 51  work_wait                   work NULL                                         "work is NULL"
 * 52  work_wait                   forged handle                                     "not a live braid_work"
 * 53  work_wait                   a braid_comm passed as work                       "is a braid_comm"
 * 54  all_reduce                  a braid_work passed as comm                       "is a braid_work"
 * 55  work_test                   done NULL                                         "done is NULL"
 * 56  work_free                   freed twice                                       "not a live braid_work"
 * 57  all_reduce                  comm used after destroy                           "not a live braid_comm"
 * 58  comm_destroy                destroyed twice                                   "not a live braid_comm"
 * 59  comm_destroy, work_free     NULL                                              success, no effect
 * 60  all_reduce                  count 0, NULL and unaligned buffers               success, no effect
 * 61  get_error_string            12345                                             "unknown result code"
 * 62  get_unique_id_at            listen_addr "nowhere:99999"                       "listen_addr"
 * 63  comm_use_cuda_device        device -2                                         "device -2"
 * 64  comm_use_cuda_device        a forged comm                                     "braid_comm"
 */
#include <stdint.h>

#include "check.h"

#define N 16

static braid_comm *g_comm;  /* the job's communicator */
static braid_comm *g_dead;  /* a destroyed one-rank communicator */
static int g_world;
static float g_a[N], g_b[N]; /* send and receive buffers, checked unchanged after each case */
static braid_comm *const FORGED_COMM = (braid_comm *)(uintptr_t)0x1230;

static braid_unique_id good_id(void) {
  braid_unique_id id;
  memset(&id, 0, sizeof id);
  snprintf(id.internal, sizeof id.internal, "127.0.0.1:1/%032d", 0);
  return id;
}

static braid_config good_cfg(void) {
  braid_config c;
  CHECK(braid_config_init(&c));
  return c;
}

/* Init with a given config; *out must stay untouched. */
static braid_result init_with(braid_config c) {
  braid_comm *out = FORGED_COMM;
  braid_result rc = braid_comm_init_rank(&out, 2, good_id(), 0, &c);
  EXPECT(out == FORGED_COMM, "init_rank wrote *out on failure");
  return rc;
}

static braid_result c01(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, NULL, NULL); }
static braid_result c02(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, FORGED_COMM, NULL); }
static braid_result c03(void) { return braid_all_reduce(g_a, g_b, N, 42, BRAID_SUM, g_comm, NULL); }
static braid_result c04(void) { return braid_all_reduce(g_a, g_b, N, -1, BRAID_SUM, g_comm, NULL); }
static braid_result c05(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, 99, g_comm, NULL); }
static braid_result c06(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, -3, g_comm, NULL); }
static braid_result c07(void) { return braid_all_reduce(NULL, g_b, 4, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL); }
static braid_result c08(void) { return braid_all_reduce(g_a, NULL, 4, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL); }
static braid_result c09(void) { return braid_all_reduce(g_a, g_b, SIZE_MAX, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL); }
static braid_result c10(void) { return braid_all_reduce(g_a, g_b, SIZE_MAX / 4 + 1, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL); }
static braid_result c11(void) { return braid_all_reduce(g_a, g_b, SIZE_MAX / 2 + 1, BRAID_UINT8, BRAID_SUM, g_comm, NULL); }
static braid_result c12(void) {
  return braid_all_reduce((const void *)(UINTPTR_MAX - 8), g_b, 16, BRAID_UINT8, BRAID_SUM, g_comm, NULL);
}
static braid_result c13(void) { return braid_all_reduce(g_b, g_b + 1, 8, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL); }
static braid_result c63(void) { return braid_comm_use_cuda_device(g_comm, -2); }
static braid_result c64(void) { return braid_comm_use_cuda_device(FORGED_COMM, 0); }
static braid_result c14(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, g_comm, (void *)g_a); }
static braid_result c15(void) {
  /* sendbuf holds nranks blocks of 2; recvbuf starts one element into it. */
  return braid_reduce_scatter(g_b, g_b + 1, 2, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL);
}
static braid_result c16(void) { return braid_reduce_scatter(g_a, g_b, SIZE_MAX / 2, BRAID_UINT8, BRAID_SUM, g_comm, NULL); }
static braid_result c17(void) { return braid_all_gather(g_a, g_b, SIZE_MAX / 2, BRAID_UINT8, g_comm, NULL); }
static braid_result c18(void) { return braid_all_gather(g_a, NULL, 2, BRAID_FLOAT32, g_comm, NULL); }
static braid_result c19(void) {
  /* In place would be sendbuf = recvbuf + rank·2; this is one element off. */
  return braid_all_gather(g_b + 1, g_b, 2, BRAID_FLOAT32, g_comm, NULL);
}
static braid_result c20(void) { return braid_broadcast(g_a, g_b, N, BRAID_FLOAT32, -1, g_comm, NULL); }
static braid_result c21(void) { return braid_broadcast(g_a, g_b, N, BRAID_FLOAT32, g_world, g_comm, NULL); }
static braid_result c22(void) { return braid_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, 1000, g_comm, NULL); }
static braid_result c23(void) { return braid_reduce(g_a, g_b, N, BRAID_FLOAT32, 8, 0, g_comm, NULL); }
static braid_result c24(void) { return braid_barrier(NULL, NULL); }
static braid_result c25(void) { return braid_barrier(g_comm, (void *)1); }
static braid_result c26(void) { return braid_comm_count(g_comm, NULL); }
static braid_result c27(void) { int x = 7; braid_result rc = braid_comm_rank(FORGED_COMM, &x); EXPECT(x == 7, "rank written"); return rc; }
static braid_result c28(void) { return braid_comm_get_async_error(g_comm, NULL); }
static braid_result c29(void) { return braid_comm_abort(NULL); }
static braid_result c30(void) { return braid_comm_init_rank(NULL, 2, good_id(), 0, NULL); }
static braid_result c31(void) { braid_comm *o = NULL; return braid_comm_init_rank(&o, -2, good_id(), 0, NULL); }
static braid_result c32(void) { braid_comm *o = NULL; return braid_comm_init_rank(&o, 0, good_id(), 0, NULL); }
static braid_result c33(void) { braid_comm *o = NULL; return braid_comm_init_rank(&o, 2, good_id(), -1, NULL); }
static braid_result c34(void) { braid_comm *o = NULL; return braid_comm_init_rank(&o, 2, good_id(), 2, NULL); }
static braid_result c35(void) {
  braid_unique_id id;
  memset(&id, 'x', sizeof id);
  braid_comm *o = NULL;
  return braid_comm_init_rank(&o, 2, id, 0, NULL);
}
static braid_result c36(void) {
  braid_unique_id id;
  memset(&id, 0, sizeof id);
  strcpy(id.internal, "this is not an id");
  braid_comm *o = NULL;
  return braid_comm_init_rank(&o, 2, id, 0, NULL);
}
static braid_result c37(void) { braid_config c = good_cfg(); c.magic = 0xdeadbeef; return init_with(c); }
static braid_result c38(void) { braid_config c = good_cfg(); c.version = 99; return init_with(c); }
static braid_result c39(void) { braid_config c = good_cfg(); c.size = 12; return init_with(c); }
static braid_result c40(void) { braid_config c = good_cfg(); c.reserved[5] = 1; return init_with(c); }
static braid_result c41(void) { braid_config c = good_cfg(); c.debug_checks = 5; return init_with(c); }
static braid_result c42(void) { braid_config c = good_cfg(); c.timeout_ms = 86400001u; return init_with(c); }
static braid_result c43(void) { return braid_config_init(NULL); }
static braid_result c44(void) { return braid_get_unique_id(NULL); }
static braid_result c45(void) { return braid_get_version(NULL); }
static braid_result c46(void) { return braid_all_reduce_async(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL, NULL); }
static braid_result c47(void) {
  braid_work *w = NULL;
  braid_result rc = braid_all_reduce_async(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, g_comm, (void *)g_b, &w);
  EXPECT(w == NULL, "a work handle was written on failure");
  return rc;
}
static braid_result c48(void) { braid_work *w = NULL; return braid_all_gather_async(NULL, g_b, 3, BRAID_FLOAT32, g_comm, NULL, &w); }
static braid_result c49(void) { braid_work *w = NULL; return braid_broadcast_async(g_a, g_b, N, BRAID_FLOAT32, 9999, g_comm, NULL, &w); }
static braid_result c50(void) { return braid_barrier_async(g_comm, NULL, NULL); }
static braid_result c51(void) { return braid_work_wait(NULL); }
static braid_result c52(void) { return braid_work_wait((braid_work *)(uintptr_t)0x4560); }
static braid_result c53(void) { return braid_work_wait((braid_work *)g_comm); }

/* Cases that need a live work handle: a barrier every rank issues, then waits for and frees. */
static braid_work *g_work;
static braid_result c54(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, (braid_comm *)g_work, NULL); }
static braid_result c55(void) { return braid_work_test(g_work, NULL); }
static braid_result c56(void) {
  braid_work *w;
  CHECK(braid_barrier_async(g_comm, NULL, &w));
  CHECK(braid_work_wait(w));
  CHECK(braid_work_free(w));
  return braid_work_free(w);
}
static braid_result c57(void) { return braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, g_dead, NULL); }
static braid_result c58(void) { return braid_comm_destroy(g_dead); }
static braid_result c59(void) {
  CHECK(braid_comm_destroy(NULL));
  return braid_work_free(NULL);
}
static braid_result c60(void) {
  CHECK(braid_all_reduce(NULL, NULL, 0, BRAID_FLOAT64, BRAID_SUM, g_comm, NULL));
  return braid_all_reduce((char *)g_a + 1, (char *)g_b + 3, 0, BRAID_FLOAT64, BRAID_MAX, g_comm, NULL);
}
static braid_result c61(void) {
  const char *s = braid_get_error_string(12345);
  EXPECT(strcmp(s, "unknown result code") == 0, "error string of 12345: %s", s);
  return BRAID_SUCCESS;
}

static braid_result c62(void) {
  braid_unique_id id;
  memset(&id, 0x5a, sizeof id);
  braid_result rc = braid_get_unique_id_at(&id, "nowhere:99999");
  for (size_t i = 0; i < sizeof id.internal; i++)
    EXPECT(id.internal[i] == 0x5a, "get_unique_id_at wrote the id on failure");
  return rc;
}

struct hostile_case {
  const char *name;
  braid_result (*call)(void);
  braid_result expect;
  const char *message; /* must appear in braid_get_last_error_message(); "" on success */
};

#define INV BRAID_INVALID_ARGUMENT
static const struct hostile_case CASES[] = {
    {"all_reduce comm NULL", c01, INV, "comm is NULL"},
    {"all_reduce forged comm", c02, INV, "not a live braid_comm"},
    {"all_reduce dtype 42", c03, INV, "dtype 42"},
    {"all_reduce dtype -1", c04, INV, "dtype -1"},
    {"all_reduce op 99", c05, INV, "op 99"},
    {"all_reduce op -3", c06, INV, "op -3"},
    {"all_reduce sendbuf NULL", c07, INV, "sendbuf is NULL"},
    {"all_reduce recvbuf NULL", c08, INV, "recvbuf is NULL"},
    {"all_reduce count SIZE_MAX", c09, INV, "overflows"},
    {"all_reduce count bytes wrap", c10, INV, "overflows"},
    {"all_reduce count past isize", c11, INV, "overflows"},
    {"all_reduce buffer wraps memory", c12, INV, "end of the address space"},
    {"all_reduce partial overlap", c13, INV, "overlap"},
    {"all_reduce stream", c14, INV, "has no device (call braid_comm_use_cuda_device first"},
    {"reduce_scatter partial overlap", c15, INV, "overlap"},
    {"reduce_scatter count overflow", c16, INV, "recvcount"},
    {"all_gather count overflow", c17, INV, "sendcount"},
    {"all_gather recvbuf NULL", c18, INV, "recvbuf is NULL"},
    {"all_gather wrong in-place block", c19, INV, "overlap"},
    {"broadcast root -1", c20, INV, "root -1"},
    {"broadcast root nranks", c21, INV, "out of range"},
    {"reduce root 1000", c22, INV, "root 1000"},
    {"reduce op 8", c23, INV, "op 8"},
    {"barrier comm NULL", c24, INV, "comm is NULL"},
    {"barrier stream", c25, INV, "stream"},
    {"comm_count out NULL", c26, INV, "out is NULL"},
    {"comm_rank forged", c27, INV, "not a live braid_comm"},
    {"get_async_error out NULL", c28, INV, "out is NULL"},
    {"comm_abort NULL", c29, INV, "comm is NULL"},
    {"init_rank out NULL", c30, INV, "out is NULL"},
    {"init_rank nranks -2", c31, INV, "nranks is negative"},
    {"init_rank nranks 0", c32, INV, "nranks is 0"},
    {"init_rank rank -1", c33, INV, "rank is negative"},
    {"init_rank rank == nranks", c34, INV, "out of range"},
    {"init_rank id without NUL", c35, INV, "NUL-terminated"},
    {"init_rank id garbage", c36, INV, "not a braid unique id"},
    {"init_rank cfg magic", c37, INV, "magic"},
    {"init_rank cfg version", c38, INV, "version"},
    {"init_rank cfg size", c39, INV, "size"},
    {"init_rank cfg reserved", c40, INV, "reserved"},
    {"init_rank cfg debug_checks", c41, INV, "debug_checks"},
    {"init_rank cfg timeout_ms", c42, INV, "timeout_ms"},
    {"config_init NULL", c43, INV, "cfg is NULL"},
    {"get_unique_id NULL", c44, INV, "out is NULL"},
    {"get_version NULL", c45, INV, "version is NULL"},
    {"all_reduce_async out NULL", c46, INV, "out is NULL"},
    {"all_reduce_async stream", c47, INV, "stream"},
    {"all_gather_async sendbuf NULL", c48, INV, "sendbuf is NULL"},
    {"broadcast_async root 9999", c49, INV, "root 9999"},
    {"barrier_async out NULL", c50, INV, "out is NULL"},
    {"work_wait NULL", c51, INV, "work is NULL"},
    {"work_wait forged", c52, INV, "not a live braid_work"},
    {"work_wait given a comm", c53, INV, "is a braid_comm, not a braid_work"},
    {"all_reduce given a work", c54, INV, "is a braid_work, not a braid_comm"},
    {"work_test done NULL", c55, INV, "done is NULL"},
    {"work_free twice", c56, INV, "not a live braid_work"},
    {"all_reduce after destroy", c57, INV, "not a live braid_comm"},
    {"comm_destroy twice", c58, INV, "not a live braid_comm"},
    {"destroy and free NULL", c59, BRAID_SUCCESS, ""},
    {"count 0 with NULL and unaligned buffers", c60, BRAID_SUCCESS, ""},
    {"error string of an unknown code", c61, BRAID_SUCCESS, ""},
    {"get_unique_id_at bad address", c62, INV, "listen_addr"},
    {"use_cuda_device -2", c63, INV, "device -2: pass a CUDA device ordinal, or -1"},
    {"use_cuda_device forged comm", c64, INV, "braid_comm"},
};

static void reset_buffers(void) {
  for (int i = 0; i < N; i++) {
    g_a[i] = (float)(i + 1);
    g_b[i] = -1.0f;
  }
}

static void expect_buffers_unchanged(const char *name) {
  for (int i = 0; i < N; i++) {
    EXPECT(g_a[i] == (float)(i + 1), "%s: sendbuf[%d] changed to %g", name, i, g_a[i]);
    EXPECT(g_b[i] == -1.0f, "%s: recvbuf[%d] changed to %g", name, i, g_b[i]);
  }
}

int main(void) {
  const char *rank_s = getenv("BRAID_RANK");
  EXPECT(rank_s, "run me under `braid run -n N`");
  g_rank = atoi(rank_s);
  CHECK(braid_comm_init_from_env(&g_comm));
  CHECK(braid_comm_count(g_comm, &g_world));

  /* A one-rank communicator of this process, destroyed, for the use-after-destroy cases. */
  braid_unique_id id;
  CHECK(braid_get_unique_id(&id));
  CHECK(braid_comm_init_rank(&g_dead, 1, id, 0, NULL));
  float x = 3;
  CHECK(braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, g_dead, NULL));
  EXPECT(x == 3, "one-rank all_reduce gave %g", x);
  CHECK(braid_comm_destroy(g_dead));

  CHECK(braid_barrier_async(g_comm, NULL, &g_work));

  size_t ncases = sizeof CASES / sizeof CASES[0];
  EXPECT(ncases >= 30, "only %zu hostile cases", ncases);
  for (size_t i = 0; i < ncases; i++) {
    const struct hostile_case *c = &CASES[i];
    reset_buffers();
    braid_result rc = c->call();
    const char *msg = braid_get_last_error_message();
    EXPECT(rc == c->expect, "case %zu (%s): returned %d (%s), expected %d; message: %s", i + 1,
           c->name, (int)rc, braid_get_error_string(rc), (int)c->expect, msg);
    EXPECT(msg != NULL, "case %zu (%s): NULL message", i + 1, c->name);
    if (c->message[0]) {
      EXPECT(strstr(msg, c->message), "case %zu (%s): message %s does not contain %s", i + 1,
             c->name, msg, c->message);
    }
    expect_buffers_unchanged(c->name);
  }

  CHECK(braid_work_wait(g_work));
  CHECK(braid_work_free(g_work));

  /* The communicator is still healthy and works. */
  braid_result async_rc = BRAID_INTERNAL;
  CHECK(braid_comm_get_async_error(g_comm, &async_rc));
  EXPECT(async_rc == BRAID_SUCCESS, "async error after hostile input: %d", async_rc);
  reset_buffers();
  CHECK(braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL));
  for (int i = 0; i < N; i++)
    EXPECT(g_b[i] == (float)((i + 1) * g_world), "all_reduce after hostile input: %g", g_b[i]);

  CHECK(braid_barrier(g_comm, NULL));

  /* A CUDA device, every rank at once: where there is none (no driver, no GPU) every rank gets an error
   * that says so, and the communicator keeps working on the host; where there is one it succeeds, a
   * second call is refused, and host memory with the host stream still works. */
  braid_result dev_rc = braid_comm_use_cuda_device(g_comm, -1);
  if (dev_rc != BRAID_SUCCESS) {
    const char *msg = braid_get_last_error_message();
    EXPECT(strstr(msg, "CUDA") || strstr(msg, "another rank failed"), "use_cuda_device: %s", msg);
  } else {
    EXPECT(braid_comm_use_cuda_device(g_comm, -1) == BRAID_INVALID_ARGUMENT &&
               strstr(braid_get_last_error_message(), "already uses CUDA device"),
           "a second use_cuda_device: %s", braid_get_last_error_message());
  }
  reset_buffers();
  CHECK(braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, g_comm, NULL));
  for (int i = 0; i < N; i++)
    EXPECT(g_b[i] == (float)((i + 1) * g_world), "all_reduce after use_cuda_device: %g", g_b[i]);

  /* Abort, on a one-rank communicator of this process (aborting the job's would race with the peers'
   * last receives): later calls fail fast with ABORTED or POISONED, and the handle still needs
   * destroying. */
  braid_comm *solo;
  CHECK(braid_get_unique_id(&id));
  CHECK(braid_comm_init_rank(&solo, 1, id, 0, NULL));
  CHECK(braid_comm_abort(solo));
  braid_result rc = braid_all_reduce(g_a, g_b, N, BRAID_FLOAT32, BRAID_SUM, solo, NULL);
  EXPECT(rc == BRAID_ABORTED || rc == BRAID_POISONED, "all_reduce after abort returned %d", rc);
  EXPECT(strstr(braid_get_last_error_message(), "abort"), "message after abort: %s",
         braid_get_last_error_message());
  CHECK(braid_comm_get_async_error(solo, &async_rc));
  EXPECT(async_rc == BRAID_ABORTED, "async error after abort: %d", async_rc);
  EXPECT(strstr(braid_get_last_error_message(), "abort"), "async error message: %s",
         braid_get_last_error_message());
  CHECK(braid_comm_destroy(solo));
  CHECK(braid_comm_destroy(g_comm));
  printf("rank %d: %zu hostile cases ok\n", g_rank, ncases);
  return 0;
}
