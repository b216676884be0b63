/* A process that changes its pid all the time (tests/launch: a job's helper that a listing of
 * pids never catches): it forks, lets the parent exit and takes a session of its own in the
 * child, over and over (some 9,000 times a second here).  ./hopper DIR writes "PID HOPS" to
 * DIR/beat every 50 ms, and stops by itself once DIR/stop exists or after 60 s. */
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    char beat[4096], tmp[4096], stop[4096];
    if (argc != 2) return 2;
    snprintf(beat, sizeof beat, "%s/beat", argv[1]);
    snprintf(tmp, sizeof tmp, "%s/beat.tmp", argv[1]);
    snprintf(stop, sizeof stop, "%s/stop", argv[1]);
    setsid();
    double end = now() + 60, next = 0;
    long hops = 0;
    while (now() < end) {
        if (now() > next) {
            if (access(stop, F_OK) == 0) break;
            FILE *f = fopen(tmp, "w");
            if (f) {
                fprintf(f, "%d %ld\n", (int)getpid(), hops);
                fclose(f);
                rename(tmp, beat);
            }
            next = now() + 0.05;
        }
        pid_t child = fork();
        if (child > 0) _exit(0);
        if (child == 0) {
            setsid();
            hops++;
        }
    }
    return 0;
}
