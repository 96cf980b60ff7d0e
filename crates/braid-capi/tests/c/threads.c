/* Two ranks as two threads of one process, joined through braid_get_unique_id: an all-reduce, then
 * braid_comm_abort from a third thread ending a collective that can never complete (its peer is not
 * calling), well before the timeout. Run directly, without a launcher. */
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define TIMEOUT_MS 20000

static braid_unique_id g_id;
static braid_comm *g_comms[2];
static braid_result g_blocked_rc = BRAID_SUCCESS;
static double g_blocked_seconds;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *rank_main(void *arg) {
  int rank = (int)(intptr_t)arg;
  braid_config cfg;
  CHECK(braid_config_init(&cfg));
  cfg.timeout_ms = TIMEOUT_MS;
  CHECK(braid_comm_init_rank(&g_comms[rank], 2, g_id, rank, &cfg));
  float x[3] = {1.0f + (float)rank, 2, 3};
  CHECK(braid_all_reduce(x, x, 3, BRAID_FLOAT32, BRAID_SUM, g_comms[rank], NULL));
  EXPECT(x[0] == 3 && x[1] == 4 && x[2] == 6, "thread rank %d: got %g %g %g", rank, x[0], x[1], x[2]);
  return NULL;
}

static void *blocked_main(void *arg) {
  (void)arg;
  float y = 1;
  double t0 = now();
  /* Rank 1 never joins this one: only the abort can end it before the timeout. */
  g_blocked_rc = braid_all_reduce(&y, &y, 1, BRAID_FLOAT32, BRAID_SUM, g_comms[0], NULL);
  g_blocked_seconds = now() - t0;
  return NULL;
}

int main(void) {
  g_rank = 0;
  CHECK(braid_get_unique_id(&g_id));
  EXPECT(strchr(g_id.internal, '/') != NULL, "unique id text %s", g_id.internal);
  pthread_t t[2];
  for (int r = 0; r < 2; r++)
    EXPECT(pthread_create(&t[r], NULL, rank_main, (void *)(intptr_t)r) == 0, "pthread_create");
  for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);

  pthread_t blocked;
  EXPECT(pthread_create(&blocked, NULL, blocked_main, NULL) == 0, "pthread_create");
  usleep(300 * 1000);
  CHECK(braid_comm_abort(g_comms[0]));
  pthread_join(blocked, NULL);
  EXPECT(g_blocked_rc == BRAID_ABORTED || g_blocked_rc == BRAID_POISONED,
         "the blocked all_reduce returned %d (%s)", g_blocked_rc, braid_get_error_string(g_blocked_rc));
  EXPECT(g_blocked_seconds < TIMEOUT_MS / 1000.0 / 2, "abort took %.1f s to end the collective",
         g_blocked_seconds);

  braid_result async_rc;
  CHECK(braid_comm_get_async_error(g_comms[0], &async_rc));
  EXPECT(async_rc == BRAID_ABORTED, "rank 0 async error %d", async_rc);
  for (int r = 0; r < 2; r++) CHECK(braid_comm_destroy(g_comms[r]));
  printf("threads ok (abort ended the collective after %.2f s)\n", g_blocked_seconds);
  return 0;
}
