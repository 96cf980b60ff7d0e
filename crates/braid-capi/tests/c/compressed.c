/* Compressed all-reduce through braid.h: every codec gives bit-identical results on every rank and takes
 * its path; the lossless ones (none, fp16 on small integers) give the exact average; error feedback
 * carries what top-k dropped into the next step; bad input is rejected without effect.
 * Run as every rank of `braid run -n N`. */
#include <math.h>
#include <stdint.h>

#include "check.h"

#define LEN 4096

static int g_world;

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* Every rank holds the same bits. */
static void expect_identical(braid_comm *comm, const float *g, const char *what) {
  uint64_t mine = fnv(g, LEN * sizeof(float)), all[64];
  CHECK(braid_all_gather(&mine, all, 1, BRAID_UINT64, comm, NULL));
  for (int r = 0; r < g_world; r++)
    EXPECT(all[r] == mine, "%s: rank %d's result differs from rank %d's", what, r, g_rank);
}

static void fill(float *g, int rank) {
  for (int i = 0; i < LEN; i++) g[i] = (float)((rank * 7 + i * 3) % 17) - 8.0f;
}

int main(void) {
  const char *rank_s = getenv("BRAID_RANK");
  EXPECT(rank_s, "run me under `braid run -n N`");
  g_rank = atoi(rank_s);
  braid_comm *comm;
  CHECK(braid_comm_init_from_env(&comm));
  CHECK(braid_comm_count(comm, &g_world));
  EXPECT(g_world <= 64, "at most 64 ranks");

  static const struct {
    const char *spec;
    braid_compress_path path, alt;
    int exact;
  } codecs[] = {
      {"none", BRAID_PATH_DENSE, BRAID_PATH_DENSE, 1},
      {"fp16", BRAID_PATH_SUM_CLOSED, BRAID_PATH_SUM_CLOSED, 1},
      {"bf16", BRAID_PATH_SUM_CLOSED, BRAID_PATH_SUM_CLOSED, 0},
      {"topk:0.1", BRAID_PATH_SPARSE_ALL_GATHER, BRAID_PATH_SPARSE_DENSE_SWITCH, 0},
      /* The traffic model gathers on two ranks and reduce-scatters from three on. */
      {"topk:0.1/sparse=auto", BRAID_PATH_SPARSE_ALL_GATHER, BRAID_PATH_SPARSE_REDUCE_SCATTER, 0},
      {"int8", BRAID_PATH_TWO_PHASE, BRAID_PATH_TWO_PHASE, 0},
      {"sign", BRAID_PATH_TWO_PHASE, BRAID_PATH_TWO_PHASE, 0},
      {"powersgd:2", BRAID_PATH_POWER_ITERATION, BRAID_PATH_POWER_ITERATION, 0},
  };
  float *g = malloc(LEN * sizeof(float));
  for (size_t k = 0; k < sizeof codecs / sizeof codecs[0]; k++) {
    braid_compressor *c;
    CHECK(braid_compressor_create(&c, codecs[k].spec, 1, LEN));
    for (int step = 0; step < 3; step++) {
      fill(g, g_rank + step);
      braid_compress_stats st;
      memset(&st, 0xff, sizeof st);
      CHECK(braid_all_reduce_compressed(g, LEN, BRAID_AVG, c, comm, &st));
      EXPECT(st.path == codecs[k].path || st.path == codecs[k].alt, "%s: path %d", codecs[k].spec,
             st.path);
      if (codecs[k].alt == BRAID_PATH_SPARSE_REDUCE_SCATTER)
        EXPECT(st.path == (g_world >= 3 ? BRAID_PATH_SPARSE_REDUCE_SCATTER : BRAID_PATH_SPARSE_ALL_GATHER),
               "%s on %d ranks: path %d", codecs[k].spec, g_world, st.path);
      EXPECT(st.len == LEN && st.step == (uint64_t)step + 1, "%s: len %llu step %llu", codecs[k].spec,
             (unsigned long long)st.len, (unsigned long long)st.step);
      EXPECT(st.density > 0 && st.density <= 1, "%s: density %g", codecs[k].spec, st.density);
      EXPECT(st.compression_error >= 0 && st.grad_norm > 0, "%s: error %g, norm %g", codecs[k].spec,
             st.compression_error, st.grad_norm);
      EXPECT(st.dense_bytes == 4 * LEN && st.wire_bytes > 0, "%s: bytes %llu %llu", codecs[k].spec,
             (unsigned long long)st.dense_bytes, (unsigned long long)st.wire_bytes);
      expect_identical(comm, g, codecs[k].spec);
      if (codecs[k].exact) {
        EXPECT(st.compression_error == 0, "%s: compression error %g", codecs[k].spec,
               st.compression_error);
        for (int i = 0; i < LEN; i++) {
          double want = 0;
          for (int r = 0; r < g_world; r++) want += (double)((((r + step) * 7 + i * 3) % 17) - 8);
          want /= g_world;
          EXPECT(g[i] == (float)want, "%s: element %d is %g, expected %g", codecs[k].spec, i, g[i],
                 want);
        }
      }
    }
    CHECK(braid_compressor_reset(c));
    /* Without stats, unaligned: the call still works. */
    char *raw = malloc(LEN * sizeof(float) + 1);
    fill(g, g_rank);
    memcpy(raw + 1, g, LEN * sizeof(float));
    CHECK(braid_all_reduce_compressed((float *)(void *)(raw + 1), LEN, BRAID_SUM, c, comm, NULL));
    free(raw);
    CHECK(braid_compressor_destroy(c));
  }

  /* The learning rate: the same rate twice changes nothing; a halved one doubles what was held back,
     so the second step's result differs; bad rates are refused. */
  {
    braid_compressor *same, *halved;
    float *h = malloc(LEN * sizeof(float));
    CHECK(braid_compressor_create(&same, "topk:0.1", 1, LEN));
    CHECK(braid_compressor_create(&halved, "topk:0.1", 1, LEN));
    for (int step = 0; step < 2; step++) {
      CHECK(braid_compressor_set_learning_rate(same, 0.1f));
      CHECK(braid_compressor_set_learning_rate(halved, step == 0 ? 0.1f : 0.05f));
      fill(g, g_rank + step);
      fill(h, g_rank + step);
      CHECK(braid_all_reduce_compressed(g, LEN, BRAID_AVG, same, comm, NULL));
      CHECK(braid_all_reduce_compressed(h, LEN, BRAID_AVG, halved, comm, NULL));
      int differ = memcmp(g, h, LEN * sizeof(float)) != 0;
      EXPECT(differ == (step == 1), "step %d: results %s", step, differ ? "differ" : "equal");
    }
    EXPECT(braid_compressor_set_learning_rate(same, -1.0f) == BRAID_INVALID_ARGUMENT &&
               strstr(braid_get_last_error_message(), "learning rate"),
           "negative rate: %s", braid_get_last_error_message());
    EXPECT(braid_compressor_set_learning_rate(same, NAN) == BRAID_INVALID_ARGUMENT, "NaN rate accepted");
    CHECK(braid_compressor_set_learning_rate(same, 0.0f));
    CHECK(braid_compressor_destroy(same));
    CHECK(braid_compressor_destroy(halved));
    EXPECT(braid_compressor_set_learning_rate(same, 0.1f) == BRAID_INVALID_ARGUMENT,
           "a destroyed compressor took a rate");
    free(h);
  }

  /* Options in the codec text: momentum correction, a density warm-up, Adam-safe compression. */
  {
    braid_compressor *mc, *adam;
    CHECK(braid_compressor_create(&mc, "topk:0.01/momentum=0.9/warmup=2:0.5", -1, LEN));
    CHECK(braid_compressor_create(&adam, "topk:0.1/adam=1", -1, LEN));
    for (int step = 0; step < 3; step++) {
      braid_compress_stats st;
      fill(g, g_rank + step);
      CHECK(braid_all_reduce_compressed(g, LEN, BRAID_AVG, mc, comm, &st));
      EXPECT(st.output == BRAID_OUTPUT_GRADIENT, "momentum correction: output %d", st.output);
      EXPECT(step > 0 || st.scheduled_density == 0.5, "warm-up starts at %g", st.scheduled_density);
      EXPECT(step < 2 || fabs(st.scheduled_density - 0.01) < 1e-7, "warm-up ends at %g",
             st.scheduled_density);
      fill(g, g_rank + step);
      CHECK(braid_all_reduce_compressed(g, LEN, BRAID_AVG, adam, comm, &st));
      EXPECT(st.output == (step == 0 ? BRAID_OUTPUT_GRADIENT : BRAID_OUTPUT_MOMENTUM),
             "Adam-safe step %d: output %d", step, st.output);
      EXPECT(step > 0 || st.path == BRAID_PATH_DENSE, "Adam-safe warm-up is dense, path %d", st.path);
    }
    EXPECT(braid_all_reduce_compressed(g, LEN, BRAID_SUM, adam, comm, NULL) == BRAID_INVALID_ARGUMENT &&
               strstr(braid_get_last_error_message(), "avg"),
           "Adam-safe with sum: %s", braid_get_last_error_message());
    EXPECT(braid_compressor_create(&mc, "int8/warmup=5", 1, LEN) == BRAID_INVALID_ARGUMENT &&
               strstr(braid_get_last_error_message(), "warm-up"),
           "message: %s", braid_get_last_error_message());
    CHECK(braid_compressor_destroy(mc));
    CHECK(braid_compressor_destroy(adam));
  }

  /* Per-layer PowerSGD: two weights, their biases and a weight too small to factorise at rank 2. */
  {
    static const uint64_t dims[] = {32, 64, 32, 16, 120, 16, 40, 2};
    static const size_t ndims[] = {2, 1, 2, 1, 2};
    braid_compressor *c = NULL, *plain = NULL;
    CHECK(braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, dims, ndims, 5));
    for (int step = 0; step < 3; step++) {
      fill(g, g_rank + step);
      braid_compress_stats st;
      CHECK(braid_all_reduce_compressed(g, LEN, BRAID_SUM, c, comm, &st));
      EXPECT(st.path == BRAID_PATH_POWER_ITERATION, "layers: path %d", st.path);
      EXPECT(st.wire_bytes < st.dense_bytes / 4, "layers: %llu wire bytes of %llu",
             (unsigned long long)st.wire_bytes, (unsigned long long)st.dense_bytes);
      EXPECT(g_world == 1 || st.sent_bytes < st.dense_sent_bytes / 2, "layers: sent %llu of %llu",
             (unsigned long long)st.sent_bytes, (unsigned long long)st.dense_sent_bytes);
      expect_identical(comm, g, "powersgd:2 with layers");
      /* The biases (2048..2080, 4000..4016) and the small weight (4016..4096) are summed exactly: the
       * small integers of fill() add up exactly in any order. */
      for (int i = 0; i < LEN; i++) {
        if (!((i >= 2048 && i < 2080) || i >= 4000)) continue;
        double want = 0;
        for (int r = 0; r < g_world; r++) want += (double)((((r + step) * 7 + i * 3) % 17) - 8);
        EXPECT(g[i] == (float)want, "layers: dense element %d is %g, expected %g", i, g[i], want);
      }
    }
    CHECK(braid_compressor_destroy(c));
    /* Only 1-D tensors (and a scalar): the same bits as no compression. */
    static const uint64_t flat[] = {4000, 95};
    static const size_t flat_n[] = {1, 1, 0};
    CHECK(braid_compressor_create_layers(&c, "powersgd:4", 1, LEN, flat, flat_n, 3));
    CHECK(braid_compressor_create(&plain, "none", 1, LEN));
    float *h = malloc(LEN * sizeof(float));
    fill(g, g_rank);
    memcpy(h, g, LEN * sizeof(float));
    braid_compress_stats st;
    CHECK(braid_all_reduce_compressed(g, LEN, BRAID_SUM, c, comm, &st));
    EXPECT(st.compression_error == 0, "1-D layers: compression error %g", st.compression_error);
    CHECK(braid_all_reduce_compressed(h, LEN, BRAID_SUM, plain, comm, NULL));
    EXPECT(memcmp(g, h, LEN * sizeof(float)) == 0, "1-D layers differ from no compression");
    free(h);
    CHECK(braid_compressor_destroy(plain));
    CHECK(braid_compressor_destroy(c));

    /* Shapes that do not fit: rejected, no handle made, the message names the problem. */
    static const uint64_t zero[] = {32, 0};
    static const size_t two[] = {2};
    c = NULL;
    struct {
      const char *name, *why;
      braid_result rc;
    } bad[] = {
        {"too few elements", "add up to", braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, dims, ndims, 4)},
        {"a zero dimension", "dimension 1 is 0", braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, zero, two, 1)},
        {"ndims NULL", "ndims is NULL", braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, dims, NULL, 5)},
        {"dims NULL", "dims is NULL", braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, NULL, ndims, 5)},
        {"nlayers huge", "overflows", braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, dims, ndims, SIZE_MAX)},
        {"out NULL", "out", braid_compressor_create_layers(NULL, "powersgd:2", 1, LEN, dims, ndims, 5)},
        {"bad codec", "codec_spec", braid_compressor_create_layers(&c, "powersgd:0", 1, LEN, dims, ndims, 5)},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
      EXPECT(bad[i].rc == BRAID_INVALID_ARGUMENT, "layers, %s: returned %d", bad[i].name, bad[i].rc);
    EXPECT(c == NULL, "a rejected call made a compressor");
    /* The messages, one call at a time. */
    for (size_t i = 0; i < 2; i++) {
      braid_result rc = i == 0 ? braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, dims, ndims, 4)
                               : braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, zero, two, 1);
      EXPECT(rc == BRAID_INVALID_ARGUMENT && strstr(braid_get_last_error_message(), bad[i].why),
             "layers, %s: message %s", bad[i].name, braid_get_last_error_message());
    }
    EXPECT(braid_compressor_create_layers(&c, "powersgd:2", 1, LEN, NULL, ndims, 5) ==
                   BRAID_INVALID_ARGUMENT &&
               strstr(braid_get_last_error_message(), "dims is NULL"),
           "layers, dims NULL: message %s", braid_get_last_error_message());
    /* No layers for an empty tensor: valid, NULL arrays included. */
    CHECK(braid_compressor_create_layers(&c, "powersgd:2", 1, 0, NULL, NULL, 0));
    CHECK(braid_compressor_destroy(c));
  }

  /* Hostile input: rejected, gradient unchanged. */
  braid_compressor *c = NULL;
  CHECK(braid_compressor_create(&c, "topk:0.5", 0, LEN));
  fill(g, g_rank);
  uint64_t before = fnv(g, LEN * sizeof(float));
  /* Each call is made once, in order; the messages of two are checked below. */
  struct {
    const char *name;
    braid_result rc;
  } r[] = {
      {"bad codec", braid_compressor_create(&c, "topk:7", 1, LEN)},
      {"unknown codec", braid_compressor_create(&c, "zip", 1, LEN)},
      {"error_feedback 3", braid_compressor_create(&c, "int8", 3, LEN)},
      {"out NULL", braid_compressor_create(NULL, "int8", 1, LEN)},
      {"count != len", braid_all_reduce_compressed(g, LEN - 1, BRAID_SUM, c, comm, NULL)},
      {"op prod", braid_all_reduce_compressed(g, LEN, BRAID_PROD, c, comm, NULL)},
      {"op 42", braid_all_reduce_compressed(g, LEN, 42, c, comm, NULL)},
      {"grad NULL", braid_all_reduce_compressed(NULL, LEN, BRAID_SUM, c, comm, NULL)},
      {"compressor NULL", braid_all_reduce_compressed(g, LEN, BRAID_SUM, NULL, comm, NULL)},
      {"comm as compressor", braid_all_reduce_compressed(g, LEN, BRAID_SUM, (braid_compressor *)comm, comm, NULL)},
      {"comm NULL", braid_all_reduce_compressed(g, LEN, BRAID_SUM, c, NULL, NULL)},
  };
  for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) {
    EXPECT(r[i].rc == BRAID_INVALID_ARGUMENT, "%s: returned %d", r[i].name, r[i].rc);
  }
  /* The messages, one call at a time (each call replaces the last message). */
  EXPECT(braid_compressor_create(&c, "topk:7", 1, LEN) == BRAID_INVALID_ARGUMENT &&
             strstr(braid_get_last_error_message(), "codec_spec"),
         "message: %s", braid_get_last_error_message());
  EXPECT(braid_all_reduce_compressed(g, LEN - 1, BRAID_SUM, c, comm, NULL) == BRAID_INVALID_ARGUMENT &&
             strstr(braid_get_last_error_message(), "len"),
         "message: %s", braid_get_last_error_message());
  EXPECT(fnv(g, LEN * sizeof(float)) == before, "a rejected call changed the gradient");
  CHECK(braid_compressor_destroy(c));
  EXPECT(braid_compressor_destroy(c) == BRAID_INVALID_ARGUMENT, "double destroy accepted");
  EXPECT(braid_compressor_reset(c) == BRAID_INVALID_ARGUMENT, "reset after destroy accepted");
  CHECK(braid_compressor_destroy(NULL));

  /* The communicator still works. */
  CHECK(braid_barrier(comm, NULL));
  CHECK(braid_comm_destroy(comm));
  free(g);
  printf("rank %d: compressed ok\n", g_rank);
  return 0;
}
