/* The README's example: run with `braid run -n 4 -- ./example`. */
#include <stdio.h>
#include <stdlib.h>
#include <braid.h>

#define CHECK(call) do { braid_result rc = (call); if (rc != BRAID_SUCCESS) { \
    fprintf(stderr, "%s: %s\n", #call, braid_get_last_error_message()); exit(1); } } while (0)

int main(void) {
  braid_comm *comm;
  CHECK(braid_comm_init_from_env(&comm));      /* or braid_comm_init_rank(&comm, n, id, rank, NULL) */
  int rank, n;
  CHECK(braid_comm_rank(comm, &rank));
  CHECK(braid_comm_count(comm, &n));
  float grads[1024];
  for (int i = 0; i < 1024; i++) grads[i] = (float)rank;
  CHECK(braid_all_reduce(grads, grads, 1024, BRAID_FLOAT32, BRAID_AVG, comm, NULL)); /* in place */
  printf("rank %d of %d: mean %g\n", rank, n, grads[0]);
  CHECK(braid_comm_destroy(comm));
  return 0;
}
