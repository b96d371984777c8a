/* The trivial program whose start-up the benchmark times. */
int main(void)
{
    return 0;
}
